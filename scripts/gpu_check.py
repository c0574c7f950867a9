"""The GPU verdict in one command: ``make gpu-check`` (``python scripts/gpu_check.py --record``).

GPUs are lent for minutes, so everything the GPU path needs proving runs here in one go and
leaves numbers behind (a dated section appended to docs/benchmarks-history.md with ``--record``):

1. ``pytest -m cuda`` (the CUDA tests: graphs, Triton sampler, device placement);
2. decode tokens/s with random weights at real shapes (Llama-3.2-1B and Llama-3.1-8B configs,
   bf16; nothing downloaded) at batch 1, 8 and 32: the engine with CUDA graphs on and off,
   transformers' ``generate`` with a static cache (eager; compiled in part 6), and the
   memory-bandwidth roofline (weights + KV-cache bytes per step over the copy bandwidth
   measured on the device);
3. one EAGLE-3 head step and one PARD draft forward (a 1B-shaped draft for the 8B target, k = 3)
   as a fraction of a target step, at batch 1 and 8, 512 tokens of context;
4. the Triton rejection sampler against the torch reference on device (identical outputs);
5. one EAGLE-3 training step at the large shape (online features, bf16 autocast, one GPU):
   tokens/s and peak memory;
6. transformers' static-cache ``generate`` compiled by transformers, last: compiling an 8B
   forward per batch size takes minutes.

``--parts tests,draft`` runs a subset in that order; on a lease, one process per part under a
timeout keeps a slow part from costing the others' numbers.

Without CUDA the same script runs at tiny shapes on the CPU and says so;
``tests/test_gpu_check.py`` runs that, so the script cannot rot. Each part catches its own
failure and reports it, so one broken part does not cost the others' numbers.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infer.engine import LLM  # noqa: E402
from infer.graphs import StaticForward  # noqa: E402
from infer.kv_cache import KVCache  # noqa: E402
from infer.models.llama import Llama, inference_layout  # noqa: E402
from infer.models.loader import config_from_hf  # noqa: E402
from infer.sampling import SamplingParams  # noqa: E402
from infer.target import Target  # noqa: E402

SHAPES = {  # Hugging Face config fields of the shapes measured
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
                         tie_word_embeddings=True),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                         tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=256, tie_word_embeddings=False),
    "tiny-draft": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
                       tie_word_embeddings=False),
}


@dataclass
class Plan:
    """What this run measures: real shapes on CUDA, tiny ones on the CPU."""

    device: torch.device
    dtype: torch.dtype
    targets: list[str]
    draft: str
    batches: list[int]
    prompt_len: int
    new_tokens: int
    train_len: int

    @classmethod
    def for_device(cls, device: str, quick: bool) -> "Plan":
        if device == "cuda":
            return cls(torch.device("cuda"), torch.bfloat16, ["llama-3.2-1b", "llama-3.1-8b"],
                       "llama-3.2-1b", [1, 8, 32], 128, 16 if quick else 128, 2048)
        return cls(torch.device("cpu"), torch.float32, ["tiny"], "tiny-draft",
                   [1, 8] if quick else [1, 8, 32], 16, 8 if quick else 32, 64)


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)

    def part(self, title: str, body: Callable[[], list[str]]) -> None:
        """Run one part; its lines, or its failure, go into the report."""
        print(f"== {title}", flush=True)
        start = time.perf_counter()
        try:
            out = body()
        except Exception as e:  # noqa: BLE001 - a broken part is a result, not the end
            traceback.print_exc()
            out = [f"FAILED: {type(e).__name__}: {str(e)[:300]}"]
        self.lines += [f"\n### {title} ({time.perf_counter() - start:.0f} s)\n", *out]
        print("\n".join(out), flush=True)


def hf_config(shape: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            **SHAPES[shape]}


def random_model(shape: str, plan: Plan, fused: bool = True) -> Llama:
    """Our Llama at ``shape`` with random weights, on the device, frozen."""
    torch.manual_seed(0)
    with plan.device:
        model = Llama(config_from_hf(hf_config(shape)))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.ndim > 1 else p.fill_(1.0)
    model = model.to(plan.dtype)
    model.tie_weights()
    model.init_buffers()
    if fused:
        inference_layout(model)
    return model.requires_grad_(False).eval()


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}
               .values())


def timed(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """Median seconds of ``fn`` after one warm-up call (synchronised on CUDA)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- 1. the CUDA tests ----------------------------------------------------------------------

def cuda_tests(plan: Plan) -> list[str]:
    if plan.device.type != "cuda":
        return ["skipped: no CUDA device (this is the CPU run of the script)"]
    # only the modules that hold CUDA tests: collecting the whole suite would import the
    # serving and logging stacks, which a bare GPU image may lack
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                   if "mark.cuda" in f.read_text())
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p",
                           "no:cacheprovider", *files], cwd=ROOT, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-15:]
    return [f"`pytest -m cuda {' '.join(files)}`: exit {proc.returncode}", "```", *tail, "```"]


# ---- 2. decode throughput -------------------------------------------------------------------

def copy_bandwidth(plan: Plan) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    n = (1 << 30) if plan.device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    return 2 * n / timed(lambda: dst.copy_(src), plan.device)


def engine_tok_s(target: Target, plan: Plan, batch: int, eager: bool) -> float:
    llm = LLM(target, max_num_seqs=batch, enforce_eager=eager)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(plan.prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=plan.new_tokens, ignore_eos=True)
    seconds = timed(lambda: llm.generate(prompts, params), plan.device, repeats=3)
    llm = None  # noqa: F841 - drop the engine before the next is built
    release()  # its KV cache and graphs: six engines at 8B would not fit at once
    return batch * plan.new_tokens / seconds


def hf_model(shape: str, plan: Plan):
    """transformers' LlamaForCausalLM at ``shape``, built in the run's dtype on the device (an
    fp32 8B copy would not fit beside ours)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in hf_config(shape).items() if k not in ("architectures",
                                                                   "model_type")}
    with plan.device:
        model = LlamaForCausalLM._from_config(LlamaConfig(**cfg), dtype=plan.dtype)
    return model.eval()


def hf_tok_s(model, plan: Plan, batch: int, compiled: bool) -> float:
    """``generate`` with a static cache; ``compiled``: transformers compiles the forward itself
    (its default for a static cache on CUDA), else the same cache run eagerly."""
    ids = torch.randint(1, 500, (batch, plan.prompt_len), device=plan.device)
    kwargs = dict(max_new_tokens=plan.new_tokens, min_new_tokens=plan.new_tokens,
                  do_sample=False, pad_token_id=0, cache_implementation="static",
                  disable_compile=not compiled)
    seconds = timed(lambda: model.generate(ids, **kwargs), plan.device, repeats=3)
    return batch * plan.new_tokens / seconds


def release() -> None:
    """Free the last shape's models and caches before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode_part(plan: Plan, bandwidth: float) -> list[str]:
    rows = ["| shape | batch | engine tok/s (graphs) | engine tok/s (eager) | transformers "
            "tok/s (static cache, eager) | roofline tok/s | engine / roofline |",
            "|---|---|---|---|---|---|---|"]
    cuda = plan.device.type == "cuda"
    for shape in plan.targets:
        release()
        model = random_model(shape, plan)
        target = Target.wrap(tempfile.mkdtemp(), model, max_model_len=4096)
        wbytes, cfg = weight_bytes(model), model.config
        kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * plan.dtype.itemsize
        hf = hf_model(shape, plan)
        for b in plan.batches:
            eager = engine_tok_s(target, plan, b, eager=True)
            graphs = engine_tok_s(target, plan, b, eager=False) if cuda else None
            hf_eager = hf_tok_s(hf, plan, b, compiled=False)
            ctx = plan.prompt_len + plan.new_tokens / 2
            floor = (wbytes + b * ctx * kv_token) / bandwidth  # seconds per step
            best = graphs or eager
            rows.append(f"| {shape} | {b} | {f'{graphs:.0f}' if graphs else '-'} | {eager:.0f} "
                        f"| {hf_eager:.0f} | {b / floor:.0f} | {best * floor / b:.2f} |")
            print(rows[-1], flush=True)  # a lease that ends mid-part keeps the rows done
        del model, target, hf
    return rows + [f"\nCopy bandwidth measured: {bandwidth / 1e9:.0f} GB/s; roofline = "
                   "(weights + KV bytes at the mean context) per step over it."]


def hf_compiled_part(plan: Plan) -> list[str]:
    """transformers at its fastest: the static-cache forward compiled by ``generate`` itself.
    Its own part, last among the decode numbers, because compiling an 8B forward per batch size
    takes minutes: a lease that runs out here has the engine's numbers already."""
    if plan.device.type != "cuda":
        return ["skipped: transformers compiles its static-cache forward on CUDA only"]
    rows = ["| shape | batch | transformers tok/s (static cache, compiled) |", "|---|---|---|"]
    for shape in plan.targets:
        release()
        hf = hf_model(shape, plan)
        for b in plan.batches:
            rows.append(f"| {shape} | {b} | {hf_tok_s(hf, plan, b, compiled=True):.0f} |")
            print(rows[-1], flush=True)
        del hf
    return rows


# ---- 3. draft step costs --------------------------------------------------------------------

CONTEXT = 512  # tokens already in every cache row when a step is timed


def step_seconds(module, cache: KVCache, inputs: tuple, plan: Plan, batch: int,
                 graphs: bool) -> float:
    """Median seconds of one cached forward of ``module`` at ``CONTEXT`` tokens of context;
    ``graphs``: through the engine's StaticForward (replayed CUDA graphs on CUDA, the same
    static-shape code run eagerly elsewhere), as the engine runs every step."""
    slots = torch.arange(batch, device=plan.device)
    static = StaticForward(module, cache) if graphs else None

    def once() -> None:
        cache.truncate(slots, CONTEXT)  # the same context every time
        if static is None:
            module(*inputs, cache)
        else:
            static(*inputs, slots=list(range(batch)), index=slots,
                   max_len=CONTEXT + inputs[0].shape[1])
    with torch.inference_mode():
        return timed(once, plan.device, repeats=10)


def eagle3_head(target: Llama, plan: Plan):
    from infer.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from train.objectives.eagle3 import resolve_aux_layer_ids

    ids = resolve_aux_layer_ids(None, target.config.num_layers)  # the trainer's default
    cfg = Eagle3Config.for_target(target.config, draft_vocab_size=min(32000,
                                  target.config.vocab_size), aux_layer_ids=ids)
    with plan.device:
        head = Eagle3Drafter(cfg)
    head = inference_layout(head.to(plan.dtype).requires_grad_(False).eval())
    head.share_embedding(target.embed_tokens)
    head.init_buffers()
    return head


def draft_costs(plan: Plan) -> list[str]:
    """One EAGLE-3 head step (one token, its own hidden state) and one PARD draft forward over
    k = 3 tokens, each over one target step (one token; PARD: the k + 1-token verify)."""
    target = random_model(plan.targets[-1], plan)
    draft = random_model(plan.draft, plan)
    head = eagle3_head(target, plan)
    h = target.config.hidden_size
    rows = ["| batch | target step ms (eager / graphs) | EAGLE-3 head step ms (eager / graphs) "
            "| head / target (graphs) | target verify k+1=4 ms (graphs) | PARD draft k=3 ms "
            "(graphs) | PARD / verify (graphs) |", "|---|---|---|---|---|---|---|"]
    for b in [x for x in plan.batches if x <= 8]:
        ids = torch.ones(b, 1, dtype=torch.long, device=plan.device)
        ids4 = torch.ones(b, 4, dtype=torch.long, device=plan.device)
        hid = torch.zeros(b, 1, h, dtype=plan.dtype, device=plan.device)

        def cost(module, model_cfg, inputs, graphs=True) -> float:
            cache = KVCache.for_model(model_cfg, b, CONTEXT + 8, dtype=plan.dtype,
                                      device=plan.device)
            return step_seconds(module, cache, inputs, plan, b, graphs)
        tgt_e, tgt = cost(target, target.config, (ids,), False), cost(target, target.config, (ids,))
        hd_e, hd = cost(head, head.layer_config, (ids, hid), False), cost(head, head.layer_config,
                                                                          (ids, hid))
        ver = cost(target, target.config, (ids4,))
        pard = cost(draft, draft.config, (ids4[:, :3],))
        rows.append(f"| {b} | {tgt_e * 1e3:.2f} / {tgt * 1e3:.2f} | {hd_e * 1e3:.2f} / "
                    f"{hd * 1e3:.2f} | {hd / tgt:.2f} | {ver * 1e3:.2f} | {pard * 1e3:.2f} | "
                    f"{pard / ver:.2f} |")
    return rows + [f"\nTarget {plan.targets[-1]}, EAGLE-3 head shaped for it (one layer, "
                   f"{head.config.draft_vocab_size}-row LM head), PARD draft {plan.draft}; "
                   f"{CONTEXT} tokens of context. Graphs: the engine's StaticForward (CUDA "
                   "graphs on CUDA; on the CPU the same static-shape path, eagerly)."]


# ---- 4. the Triton sampler on device ----------------------------------------------------------

def triton_sampler(plan: Plan) -> list[str]:
    from infer.rejection import draw_randomness, rejection_core_reference

    try:
        from infer.rejection_triton import rejection_core_triton
    except ImportError as e:
        return [f"skipped: Triton is not importable here ({e})"]
    rows = ["| batch | k | vocab | identical | reference ms | Triton ms |", "|---|---|---|---|---|---|"]
    vocab = 128256 if plan.device.type == "cuda" else 64
    for b, k in ((1, 3), (32, 5)):
        g = torch.Generator(device=plan.device).manual_seed(b)
        probs = torch.rand(b, k + 1, vocab, device=plan.device, generator=g).softmax(-1)
        q = torch.rand(b, k, vocab, device=plan.device, generator=g).softmax(-1)
        drafts = torch.randint(0, vocab, (b, k), device=plan.device, generator=g)
        num = torch.full((b,), k, device=plan.device)
        uniforms, noise = draw_randomness(b, k, vocab, plan.device, g)
        args = (probs, drafts, num, uniforms, noise, q)
        same = torch.equal(rejection_core_reference(*args), rejection_core_triton(*args))
        ref = timed(lambda: rejection_core_reference(*args), plan.device)
        tri = timed(lambda: rejection_core_triton(*args), plan.device)
        rows.append(f"| {b} | {k} | {vocab} | {'yes' if same else 'NO'} | {ref * 1e3:.3f} | "
                    f"{tri * 1e3:.3f} |")
    return rows


# ---- 5. one EAGLE-3 training step -----------------------------------------------------------

def training_step(plan: Plan) -> list[str]:
    """Online features (the frozen target's forward inside the step), the EAGLE-3 objective
    (3 TTT steps), backward, AdamW; bf16 autocast on CUDA."""
    from train.config import TrainConfig
    from train.features import capture
    from train.frozen_target import target_heads
    from train.objectives.base import OBJECTIVES
    from train.vocab import DraftVocab

    target = random_model(plan.targets[-1], plan)
    cfg = TrainConfig()
    n_draft = min(32000, target.config.vocab_size)
    vocab_size = target.config.vocab_size
    vocab = DraftVocab(torch.zeros(n_draft, dtype=torch.long),
                       torch.arange(vocab_size) < n_draft, torch.ones(vocab_size, dtype=torch.long))
    obj = OBJECTIVES.get("eagle3")(cfg, target_heads(target), vocab, tempfile.mkdtemp())
    obj = obj.to(plan.device).train()
    opt = torch.optim.AdamW([p for p in obj.parameters() if p.requires_grad], lr=1e-4)
    t = plan.train_len
    batch = {"input_ids": torch.randint(1, 500, (1, t), device=plan.device),
             "loss_mask": torch.ones(1, t, dtype=torch.bool, device=plan.device),
             "position_ids": torch.arange(t, device=plan.device)[None],
             "doc_ids": torch.zeros(1, t, dtype=torch.long, device=plan.device)}
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=plan.device.type == "cuda")

    def step() -> None:
        with autocast:
            loss = obj(capture(target, batch, obj.feature_spec())).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if plan.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = timed(step, plan.device, repeats=3)
    peak = (f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB peak allocated"
            if plan.device.type == "cuda" else "peak memory: n/a on CPU")
    return [f"{plan.targets[-1]} target, micro-batch 1 x {t} tokens, ttt_steps "
            f"{obj.ttt_steps}: {seconds * 1e3:.0f} ms per step, {t / seconds:.0f} tokens/s, "
            f"{peak}."]


# ---- the report -------------------------------------------------------------------------------

def header(plan: Plan, quick: bool) -> str:
    if plan.device.type == "cuda":
        where = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    else:
        where = (f"no CUDA device: the CPU run at tiny shapes ({platform.machine()}, "
                 f"{torch.get_num_threads()} threads); the real numbers need a GPU")
    return (f"\n## GPU check ({time.strftime('%Y-%m-%d')}): {where}\n\n`python "
            f"scripts/gpu_check.py{' --quick' if quick else ''}`, torch {torch.__version__}, "
            f"{str(plan.dtype).removeprefix('torch.')}, random weights.\n")


PARTS: dict[str, tuple[str, Callable[[Plan], list[str]]]] = {
    "tests": ("CUDA tests", cuda_tests),
    "decode": ("Decode throughput against transformers and the roofline",
               lambda plan: decode_part(plan, copy_bandwidth(plan))),
    "draft": ("Draft step costs", draft_costs),
    "triton": ("Triton rejection sampler on device", triton_sampler),
    "train": ("One EAGLE-3 training step", training_step),
    "hf-compiled": ("Decode throughput of transformers compiled", hf_compiled_part),
}


def run(device: str, quick: bool, parts: list[str]) -> str:
    plan = Plan.for_device(device, quick)
    report = Report()
    for name in parts:
        title, body = PARTS[name]
        report.part(title, lambda body=body: body(plan))
    return header(plan, quick) + "\n".join(report.lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and batch sizes")
    ap.add_argument("--record", action="store_true", help="append to docs/benchmarks-history.md")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated, run in this order (default: all of {','.join(PARTS)}); "
                         "one process per part keeps a slow part from costing the others")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; expected some of {list(PARTS)}")
    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":  # Triton kernels run through its interpreter (before any is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    text = run(device, args.quick, parts)
    print(text)
    if args.record:
        with (ROOT / "docs" / "benchmarks-history.md").open("a") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    main()
