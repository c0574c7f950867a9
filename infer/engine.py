"""The draftsmith inference engine: ``LLM`` with vLLM's constructor and ``generate`` API.

Every step runs :meth:`LLM.speculative_step` over all running requests: the proposer drafts up
to k tokens per request, one target forward verifies ``[pending token, drafts...]`` for the whole
ragged batch, the shared rejection sampler picks accepted + recovered/bonus tokens, and the KV
cache rolls rejected positions back by resetting lengths. Without a speculative config the same
function runs with zero drafts, which is plain autoregressive decoding, so "speculative equals
non-speculative" compares two uses of one code path.

Continuous batching: requests occupy KV-cache slots; finished ones free their slot at once and
waiting ones take free slots at the next step. On eager steps their prompts ride in that step's
verify forward, each as a group of its own (``Llama.forward_groups``: vLLM's flattened batch of
prefill chunks and decodes), or, when nothing runs, go in one forward of their own, unpadded.

``LLM`` keeps the public API and wires three parts, each readable on its own: the scheduler
(``infer/scheduler.py``: slots, admission, aborts), the model runner (``infer/runner.py``: the
prefill, verify and tree-verify forwards, CUDA-graph steps) and the step's verification strategy
(``infer/spec_step.py``: chain or tree).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from infer.adaptive import AdaptiveVerifier
from infer.engine_checks import (check_engine_args, check_loaded, check_memory_budget,
                                  kv_cache_bytes)
from infer.foundation.threads import GOVERNOR
from infer.foundation.validation import check_int
from infer.kv_cache import KVCache
from infer.metrics import SpecMetrics
from infer.models.output import FeatureSpec, ModelOutput, pad_outputs
from infer.proposers.base import (proposer_class, Proposal, Proposer, ProposerContext,
                                  VerifiedStep)
from infer.request import (Request, RequestOutput, make_requests, mask_early_stops,
                           request_output)
from infer.runner import ModelRunner
from infer.sampling import SamplingParams
from infer.scheduler import Scheduler
from infer.spec_config import SpeculativeConfig
from infer.spec_step import StepRows, strategy_for
from infer.step import StepPlan, plan_step
from infer.target import Target
from infer.timing import EngineTimers, measure

_WHERE = "LLM"


class LLM:
    """Offline generation engine (single device, tensor parallel size 1).

    ``model``: a model directory (loaded here: dtype "auto" is the checkpoint's dtype on CUDA,
    float32 on CPU, where bf16 matmuls are slow) or an already loaded :class:`Target`, which is
    shared, not copied (then dtype / device / max_model_len / tokenizer were fixed when it was
    loaded). ``timers``: set an :class:`~infer.timing.EngineTimers` to have every step timed.
    ``num_threads`` (CPU): torch threads, fixed; None: one per core other processes leave free,
    re-checked as it runs (:mod:`infer.foundation.threads`).
    """

    def __init__(self, model: str | Target, speculative_config: Any = None, *,
                 dtype: str = "auto", device: str = "auto", max_model_len: int | None = None,
                 max_num_seqs: int = 8, seed: int = 0, enforce_eager: bool = False,
                 gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
                 tokenizer: str | None = None, num_threads: int | None = None) -> None:
        check_engine_args(max_model_len, max_num_seqs, seed, gpu_memory_utilization,
                          tensor_parallel_size)
        self.spec = SpeculativeConfig.parse(speculative_config)
        if isinstance(model, Target):
            check_loaded(dtype, device, max_model_len, tokenizer)
            self.target = model
        else:
            self.target = Target.load(model, dtype=dtype, device=device,
                                      max_model_len=max_model_len, tokenizer=tokenizer)
        if self.spec is not None:  # resolved against the target once, here
            self.spec = self.spec.for_target(self.target.path, self.target.max_model_len)
        self.max_num_seqs, self.seed = max_num_seqs, seed
        self.num_threads = num_threads
        if self.device.type == "cpu":
            GOVERNOR.start(num_threads)  # steady beside other processes (foundation/threads.py)
        self.enforce_eager, self.gpu_memory_utilization = enforce_eager, gpu_memory_utilization
        kv_dtype, cfg = self.target.dtype, self.target.model.config
        cache_len = self.max_model_len + (self.spec.tree_columns if self.spec else 0)
        self._check_memory(kv_cache_bytes(cfg, max_num_seqs, cache_len, kv_dtype))
        self.cache = KVCache.for_model(cfg, max_num_seqs, cache_len, dtype=kv_dtype,
                                       device=self.device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.proposer = self._make_proposer()
        self._check_memory()  # the proposer's weights and caches are allocated now
        # what the proposer reads from the target's forwards (EAGLE heads: aux streams)
        self.features = self.proposer.feature_spec() if self.proposer else FeatureSpec()
        self.runner = ModelRunner(self.target, self.cache, self.features,
                                  static=self._static_steps, grouped=self._groups_prompts)
        self.scheduler = Scheduler(max_num_seqs)
        self.metrics = SpecMetrics()
        adaptive = self.spec is not None and self.spec.enable_adaptive_verification
        self.adaptive = AdaptiveVerifier() if adaptive else None

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.target.eos_ids

    @property
    def max_model_len(self) -> int:
        return self.target.max_model_len

    def _check_memory(self, cache_bytes: int = 0) -> None:
        """On CUDA: what is allocated plus ``cache_bytes`` must fit gpu_memory_utilization."""
        if self.device.type == "cuda":
            _, total = torch.cuda.mem_get_info(self.device)
            check_memory_budget(torch.cuda.memory_allocated(self.device), cache_bytes, total,
                                self.gpu_memory_utilization, self.max_num_seqs,
                                self.max_model_len)

    def with_config(self, speculative_config: Any = None, *, max_num_seqs: int | None = None,
                    seed: int | None = None) -> "LLM":
        """A new engine on this one's loaded target (nothing is reloaded), with another
        speculative config, batch size or seed (None: this engine's): how the harness runs a
        matrix of configurations. The two share the target (read-only) and nothing else."""
        check_int("max_num_seqs", max_num_seqs, _WHERE, minimum=1, optional=True)
        check_int("seed", seed, _WHERE, optional=True)
        return LLM(self.target, speculative_config,
                   max_num_seqs=max_num_seqs or self.max_num_seqs,
                   seed=self.seed if seed is None else seed, enforce_eager=self.enforce_eager,
                   gpu_memory_utilization=self.gpu_memory_utilization,
                   num_threads=self.num_threads)

    # ---- public API ------------------------------------------------------------------------------

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for prompts (strings, token-id lists, or ``{"prompt_token_ids": [...]}``).

        Returns one :class:`RequestOutput` per prompt, in order. One bad request never hurts
        the others: a request that cannot run (empty prompt, token ids outside
        ``[0, vocab_size)``, a prompt of ``max_model_len`` tokens or more, text without a
        tokenizer, SamplingParams that are not valid, checked again here in case they were
        changed after construction, stop_token_ids outside the vocabulary) gets
        ``finish_reason`` "error" and ``error`` = "prompt INDEX: what is wrong; expected ...",
        no tokens, and never reaches the model; every other request gets the tokens it would
        get alone (greedy or seeded). Only a call wrong as a whole raises ``ValueError``
        (:class:`~infer.request.GenerateError`): no prompts, prompts that are not a prompt or
        a list of them, sampling_params that are neither a SamplingParams nor a list of one
        per prompt.

        vLLM 0.32 checks the same things but raises (``VLLMValidationError``) from
        ``generate`` at the first invalid request and aborts those already added, so one bad
        prompt costs the whole batch its outputs (and ``generate([])`` returns ``[]``). An
        offline batch here is often a whole dataset (the harness, regeneration), so draftsmith
        refuses per request instead, as vLLM's server does for one HTTP request.
        docs/reference.md §8 has the details.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("generate: requests added with add_request are still running; "
                               "step() them to the end first")
        requests = make_requests(prompts, sampling_params, self.target)
        for r in requests:
            self.scheduler.add(r)
        bar = tqdm(total=len(requests), desc="generate", disable=not use_tqdm, unit="req")
        bar.update(len(requests) - self.num_waiting)
        try:
            while self.has_unfinished_requests():
                bar.update(self.step())
        except BaseException:  # Ctrl-C, a bug: free the slots, so the engine stays usable
            for r in requests:
                self.abort_request(r)
            raise
        finally:
            bar.close()
        return [request_output(r, self.target) for r in requests]

    # ---- step by step (the server's loop: infer/serve/engine_loop.py) ---------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request built by :func:`~infer.request.make_request` (a refused one is
        not queued: it is finished already). It joins the running batch at the next
        :meth:`step` with a free slot, in arrival order."""
        self.scheduler.add(request)

    def abort_request(self, request: Request) -> None:
        """Drop a waiting request, or finish a running one now ("abort") and free its KV slot
        and proposer state; the batch's other requests are not touched."""
        self.scheduler.abort(request)
        self._retire()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> int:
        """:meth:`admit` then :meth:`decode`; returns how many requests finished."""
        return self.admit() + self.decode()

    def admit(self) -> int:
        """Prefill waiting requests into free slots (again while some finish at their first
        token); returns how many finished; the server hands their first tokens out before the
        next :meth:`decode`. While requests run on grouped (eager) steps, nothing is prefilled
        here: :meth:`decode` takes waiting prompts into its verify forward, so their time to
        first token is that step's and a prompt costs no forward of its own."""
        if self.runner.grouped and self.scheduler.running:
            return 0
        finished = 0
        while True:
            for batch in self.runner.prefill_batches(self.scheduler.take()):
                with torch.inference_mode():
                    self._start(batch, self.runner.prefill(batch))
            done = self._retire()  # finished at their first token: never stepped
            finished += done
            if not (done and self.scheduler.waiting):
                return finished  # else their slots are free again: admit more first

    def decode(self) -> int:
        """One :meth:`speculative_step` over the running batch; returns how many finished."""
        if not self.scheduler.running:
            return 0
        if self.device.type == "cpu":
            GOVERNOR.tick()  # resize torch's team to the cores left free
        self.speculative_step()
        return self._retire()

    def get_metrics(self) -> dict:
        """Cumulative speculative metrics over every ``generate`` call (``infer/metrics.py``)."""
        return self.metrics.as_dict()

    @property
    def timers(self) -> EngineTimers | None:
        """Set an :class:`~infer.timing.EngineTimers` to have every step timed."""
        return self.runner.timers

    @timers.setter
    def timers(self, timers: EngineTimers | None) -> None:
        self.runner.timers = timers

    @property
    def _static_steps(self) -> bool:
        """Steps in fixed shapes (infer/graphs.py), captured as CUDA graphs: on CUDA unless
        enforce_eager (CPU tests turn it on to run the same path eagerly), and not for a
        mixture-of-experts target (its expert dispatch depends on the tokens)."""
        return (self.device.type == "cuda" and not self.enforce_eager
                and not self.target.model.config.num_experts)

    @property
    def _groups_prompts(self) -> bool:
        """Eager steps without draft trees prefill prompts unpadded (``Llama.forward_groups``),
        inside the verify forward while requests run: a speculative batch's rows finish at
        different steps, so prompts arrive one or two at a time and would cost a forward each.
        Fixed-shape (CUDA graph) steps prefill apart, in padded groups (``prefill_groups``)."""
        return not self._static_steps and not (self.spec and self.spec.draft_tree_siblings)

    @property
    def k(self) -> int:
        return self.spec.num_speculative_tokens if self.spec else 0

    # ---- the step --------------------------------------------------------------------------------

    @torch.inference_mode()  # no autograd bookkeeping at all: ~10% off a small CPU step
    def speculative_step(self) -> None:
        """Draft k -> one target forward -> verification -> advance or roll back caches."""
        with measure(self.timers and self.timers.step):
            reqs = self.scheduler.running
            # waiting prompts into free slots, prefilled inside this step's verify forward
            new = self.scheduler.take() if self.runner.grouped and self.scheduler.waiting else []
            rows = StepRows(reqs, torch.tensor([r.slot for r in reqs], device=self.device),
                            torch.tensor([r.tokens[-1] for r in reqs], device=self.device),
                            self.eos_ids)  # [B] each
            # host -> device copies above, before the proposer queues GPU work they would wait for
            plan = plan_step(reqs, self.spec, self.generator, self.device)
            proposal = self._propose(reqs, plan)
            start = time.perf_counter()
            verified = strategy_for(proposal, plan)(self.runner, rows, proposal, plan, new)
            if self.adaptive is not None:  # the outcome and the verify's cost, learned from
                self.adaptive.observe(verified.drafted, verified.accepted,
                                      time.perf_counter() - start)
            new_tokens = [self._accept(r, e, n, a) for r, e, n, a in zip(
                reqs, verified.emitted, verified.drafted, verified.accepted)]
            if self.proposer is not None:
                self.proposer.observe(VerifiedStep([r.slot for r in reqs], verified.accepted,
                                                   new_tokens, verified.out))
            if new:
                self._start(new, pad_outputs(verified.prompts))

    def _accept(self, req: Request, emitted: list[int], drafted: int, accepted: int) -> list[int]:
        """Append a request's emitted tokens (stop-aware) and record its metrics."""
        kept = req.append(emitted, self.eos_ids, self.max_model_len)
        step = SpecMetrics()
        step.record(drafted, min(accepted, kept))  # tokens after a stop are not counted
        if req.step_log is not None and drafted > 0:
            req.step_log.append((drafted, min(accepted, kept)))
        req.metrics.merge(step)
        self.metrics.merge(step)
        return emitted[:kept]

    def _propose(self, reqs: list[Request], plan: StepPlan) -> Proposal:
        """The plan's k drafts ``[B, w <= k]`` clipped per request to what max_tokens and the
        cache can take (lookup proposers return only as many columns as their longest)."""
        if self.proposer is None or plan.k == 0:
            return Proposal(torch.empty(len(reqs), 0, dtype=torch.long, device=self.device))
        batch = plan.draft_batch(reqs)
        limits = torch.tensor([r.draft_limit(plan.k, self.max_model_len) for r in reqs],
                              device=self.device)  # [B], copied before the drafts are queued
        start = time.perf_counter()
        with measure(self.timers and self.timers.draft):
            proposal = self.proposer.propose(batch)
        width = proposal.draft_ids.shape[1]
        over = torch.arange(width, device=self.device)[None, :] >= limits[:, None]  # [B, w]
        proposal.draft_ids = proposal.draft_ids.masked_fill(over, -1)
        if self.adaptive is not None and proposal.confidence is not None:
            proposal.draft_ids = self._adapt(reqs, proposal, start)
        return proposal

    def _adapt(self, reqs: list[Request], proposal: Proposal, start: float) -> torch.Tensor:
        """The drafts adaptive verification keeps (infer/adaptive.py): a prefix of each row's,
        the rest -1. ``start``: when drafting began (the draft cost it weighs)."""
        drafted = (proposal.draft_ids >= 0).sum(dim=1).tolist()  # [B] (a host sync on CUDA)
        width = proposal.draft_ids.shape[1]

        def profile() -> list[float]:  # a batch size's first step only
            slots = torch.tensor([r.slot for r in reqs], device=self.device)
            return self.runner.profile_verify(reqs, slots, self.k + 1)
        keep = self.adaptive.keep(proposal.confidence, drafted, time.perf_counter() - start,
                                  profile)
        over = (torch.arange(width, device=self.device)[None, :]
                >= torch.tensor(keep, device=self.device)[:, None])  # [B, w]
        return proposal.draft_ids.masked_fill(over, -1)

    def _start(self, reqs: list[Request], out: ModelOutput) -> None:
        """Prefilled requests (``out``: logits ``[B, 1, vocab]``, states right-padded) sample
        their first tokens and join the running batch."""
        plan = plan_step(reqs, self.spec, self.generator, self.device, drafting=False)
        empty = torch.empty(len(reqs), 0, dtype=torch.long, device=self.device)
        first = plan.verify(mask_early_stops(out.logits, reqs, self.eos_ids), Proposal(empty))
        first = first[:, 0].tolist()  # no drafts: sampled from p itself
        for req, tok in zip(reqs, first):
            req.append([tok], self.eos_ids, self.max_model_len)
            if self.proposer is not None:
                self.proposer.start(req.slot, req.prompt_ids)
        if self.proposer is not None:
            self.proposer.prefilled([r.slot for r in reqs], [len(r.prompt_ids) for r in reqs],
                                    out)
        self.scheduler.join(reqs)

    def _retire(self) -> int:
        """Free the slots (and proposer state) of finished requests; returns how many."""
        done = self.scheduler.retire()
        if self.proposer is not None:
            for req in done:
                self.proposer.finish(req.slot)
        return len(done)

    def _make_proposer(self) -> Proposer | None:
        if self.spec is None:
            return None
        cfg = self.target.model.config
        ctx = ProposerContext(self.target.model, cfg, self.device, self.target.dtype,
                              self.max_num_seqs, self.max_model_len, cfg.vocab_size,
                              self._static_steps, self.tokenizer)
        return proposer_class(self.spec)(self.spec, ctx)
