"""Generation through transformers' ``generate``, for targets draftsmith's engine does not run.

Regeneration (train/regenerate.py) needs a target that answers batches of prompts; when the
engine lacks the architecture (train/hf_target.py says why) and no vLLM is configured, the
target's own transformers implementation answers them. It is plain decoding, batched with left
padding, so it is slower than either engine, but any causal LM transformers ships works.
Duck-types what the regenerator uses of :class:`~infer.engine.LLM`, as ``VllmSession`` does:
``generate(prompt_ids, params)`` returning :class:`~infer.request.RequestOutput` objects,
``eos_ids`` and ``generator`` (re-seeded per chunk, so a resumed chunk samples the same answers).
"""

from __future__ import annotations

import torch

from infer.eval.vllm_engine import session_outputs
from infer.models.loader import token_ids
from infer.request import CompletionOutput, RequestOutput


class TransformersSession:
    """One transformers causal LM over many ``generate`` calls of ``max_num_seqs`` rows each."""

    def __init__(self, target: str, *, max_num_seqs: int, max_model_len: int | None,
                 device: str = "cpu", seed: int = 0):
        from transformers import AutoModelForCausalLM

        from infer.models.foreign import target_config
        from infer.target import TargetTokens

        cfg = target_config(target)
        tokens = TargetTokens.load(target, max_model_len=max_model_len, config=cfg)
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                                   else "cpu" if device == "auto" else device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(
            target, dtype=dtype, trust_remote_code=False).to(self.device).eval()
        self.eos_ids = tokens.eos_ids | frozenset(
            token_ids(self.model.generation_config.eos_token_id))
        self.pad_id = next(iter(token_ids(cfg.pad_token_id) or sorted(self.eos_ids) or [0]))
        self.max_model_len = tokens.max_model_len
        self.max_num_seqs = max_num_seqs
        self.generator = torch.Generator().manual_seed(seed)

    def generate(self, prompts: list[list[int]], params) -> list[RequestOutput]:
        """Outputs for ``prompts`` (token ids) with ``params`` (SamplingParams: temperature,
        top_p, max_tokens, stop_token_ids); a prompt leaving no room under ``max_model_len``
        gets an error, as in draftsmith's engine."""
        outs: dict[int, CompletionOutput] = {}
        fits = [i for i, p in enumerate(prompts) if len(p) < self.max_model_len]
        for s in range(0, len(fits), self.max_num_seqs):
            batch = fits[s:s + self.max_num_seqs]
            outs.update(zip(batch, self._batch([prompts[i] for i in batch], params)))
        return session_outputs(prompts, outs, self.max_model_len)

    @torch.no_grad()
    def _batch(self, prompts: list[list[int]], params) -> list[CompletionOutput]:
        """One left-padded ``generate`` call; each row cut after its first stop token."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, P]
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):
            ids[b, width - len(p):], mask[b, width - len(p):] = torch.tensor(p), 1
        stops = self.eos_ids | set(params.stop_token_ids or ())
        sample = params.temperature > 0
        seed = int(torch.randint(2 ** 62, (1,), generator=self.generator))
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                max_new_tokens=params.max_tokens, do_sample=sample,
                temperature=params.temperature if sample else None,
                top_p=params.top_p if sample else None, top_k=None,
                eos_token_id=sorted(stops), pad_token_id=self.pad_id)
        return [self._completion(row[width:].tolist(), self.max_model_len - len(p), stops)
                for row, p in zip(out, prompts)]

    @staticmethod
    def _completion(tokens: list[int], room: int, stops) -> CompletionOutput:
        """A row's new tokens up to and with its first stop token, within ``room``."""
        for t, token in enumerate(tokens[:room]):
            if token in stops:
                return CompletionOutput(0, "", tokens[:t + 1], "stop")
        return CompletionOutput(0, "", tokens[:room], "length")

