"""What only a GPU can show (skipped without CUDA; ``pytest -m cuda`` runs them): CUDA-graph steps
are lossless against eager steps, replay without host syncs, and bf16 serving works end to end.

The CPU twins of these checks are in test_graphs.py (the same static-shape code, run eagerly).
"""

import pytest
import torch

from infer.engine import LLM
from infer.sampling import SamplingParams

from .conftest import ENGINE_PROMPTS

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SPECS = {"autoregressive": None,
         "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
         "draft_model": "draft"}


def _spec(name, draft):
    spec = SPECS[name]
    if spec == "draft":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    return spec


@pytest.mark.parametrize("name", list(SPECS))
def test_graph_steps_equal_eager_steps(tiny_target, tiny_draft, name):
    spec = _spec(name, tiny_draft)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (12, 5, 9, 7)]
    runs = {}
    for eager in (True, False):
        llm = LLM(tiny_target, speculative_config=spec, device="cuda", dtype="float32",
                  max_num_seqs=2, enforce_eager=eager)
        runs[eager] = ([o.token_ids for o in llm.generate(ENGINE_PROMPTS, params)],
                       llm.get_metrics(), llm)
    assert runs[False][0] == runs[True][0]
    assert runs[False][1] == runs[True][1]
    llm = runs[False][2]
    runners = [llm.runner.static_forward] + ([llm.proposer.static]
                                            if name == "draft_model" else [])
    for runner in runners:  # the target's verify steps and the draft model's one-token steps
        assert runner.graphs and all(g.graph is not None for g in runner.graphs.values())


def test_graph_step_does_not_sync(tiny_target):
    """A captured step (input copies, replay, output gather) runs with no host synchronisation
    (CUDA's sync debug mode raises on one)."""
    llm = LLM(tiny_target, device="cuda", dtype="float32", max_num_seqs=4)
    llm.generate(ENGINE_PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4))
    ids = torch.tensor([[5], [7]], device="cuda")  # [B, 1]
    index = torch.tensor([2, 0], device="cuda")

    def step():  # as the engine calls it: inside inference mode, where its buffers were made
        with torch.inference_mode():
            return llm.runner.static_forward(ids, slots=[2, 0], index=index, max_len=16)

    step()  # captures this shape (capture itself synchronises)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.logits.shape[:2] == (2, 1)


def test_bf16_serving_with_graphs(tiny_target):
    spec = SPECS["ngram"]
    llm = LLM(tiny_target, speculative_config=spec, device="cuda", dtype="bfloat16")
    out = llm.generate(ENGINE_PROMPTS, SamplingParams(temperature=0.8, max_tokens=16, seed=3))
    assert all(len(o.token_ids) == 16 for o in out)
    assert llm.cache.k.dtype == torch.bfloat16 and llm.runner.static_forward.graphs


def test_gpu_memory_utilization_bounds_the_cache(tiny_target):
    with pytest.raises(ValueError, match="'gpu_memory_utilization'"):
        LLM(tiny_target, device="cuda", max_model_len=256, max_num_seqs=4096,
            gpu_memory_utilization=1e-4)


def test_masked_gqa_on_cuda_matches_cpu_with_gradients(tiny_target):
    """Masked grouped-query attention takes the grouped path on CUDA (packed training masks
    included) and agrees with the CPU path, gradients flowing."""
    from infer.models.attention import packed_causal_mask
    from infer.models.loader import load_model

    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])
    outs = {}
    for device in ("cpu", "cuda"):
        model = load_model(tiny_target, dtype=torch.float32, device=device)
        model.requires_grad_(True)
        out = model.forward_train(ids.to(device), positions.to(device),
                                  packed_causal_mask(doc_ids.to(device)))
        out.logits.sum().backward()
        outs[device] = (out.logits.cpu(), model.layers[0].self_attn.q_proj.weight.grad.cpu())
    torch.testing.assert_close(outs["cuda"][0], outs["cpu"][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs["cuda"][1], outs["cpu"][1], rtol=1e-3, atol=1e-3)
