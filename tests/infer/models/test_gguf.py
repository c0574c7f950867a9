"""GGUF -> Hugging Face folder (infer/models/gguf.py) on a GGUF written in-process."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from infer.engine import LLM
from infer.foundation.errors import FileFormatError, MissingFileError
from infer.models import gguf as conv
from infer.sampling import SamplingParams


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    path, _ = tiny_gguf
    return conv.convert_gguf(path, tmp_path_factory.mktemp("conv") / "model")


def test_weights_are_the_gguf_models_in_float32_without_the_tied_head(tiny_gguf, converted):
    _, reference = tiny_gguf
    with safe_open(str(converted / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert names == set(reference.state_dict()) - {"lm_head.weight"}
        for name in names:  # q / k rows back in transformers' order
            got = f.get_tensor(name)
            assert got.dtype == torch.float32
            assert torch.equal(got, reference.state_dict()[name]), name


def test_config_is_a_plain_float32_checkpoints(converted):
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float32" and config["tie_word_embeddings"] is True
    assert (config["num_key_value_heads"], config["num_attention_heads"]) == (2, 4)
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_tokenizer_keeps_the_ggufs_special_ids_and_chat_template(tiny_gguf, converted):
    meta = conv.read_tokenizer_meta(tiny_gguf[0])
    tok = AutoTokenizer.from_pretrained(converted)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tok.bos_token_id, tok.eos_token_id) == (meta.bos_token_id, meta.eos_token_id)
    text = tok.apply_chat_template([{"role": "user", "content": "the cat"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a tiny test assistant.<|im_end|>\n"
                    "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n")
    assert tok(text, add_special_tokens=True).input_ids[0] == 1  # one bos: the template's


def test_swapped_bos_and_eos_are_set_back_from_the_gguf(tiny_gguf, monkeypatch):
    """Older transformers swapped bos and eos of Llama GGUF tokenizers: the GGUF's ids win."""
    path, _ = tiny_gguf
    original = AutoTokenizer.from_pretrained

    def swapped(*args, **kwargs):
        tok = original(*args, **kwargs)
        tok.bos_token, tok.eos_token = tok.eos_token, tok.bos_token
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", swapped)
    tok = conv._load_tokenizer(path, conv.read_tokenizer_meta(path))
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


def test_engine_greedy_equals_transformers_on_the_converted_model(converted):
    tok = AutoTokenizer.from_pretrained(converted)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
               for q in ("the cat sat", "what is two plus two", "the dog ran to the park")]
    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    llm = LLM(str(converted), device="cpu", max_num_seqs=2)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert out.token_ids == greedy_reference(hf, ids, 12)


def greedy_reference(model, ids, n: int) -> list[int]:
    """Greedy decoding by full forwards, the plainest reference there is."""
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, -n:].tolist()


def test_missing_and_foreign_files_are_clear_errors(tmp_path):
    with pytest.raises(MissingFileError, match="does not exist"):
        conv.convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all")
    with pytest.raises(FileFormatError, match="not a readable GGUF"):
        conv.convert_gguf(bogus, tmp_path / "out")
    assert not (tmp_path / "out").exists()
