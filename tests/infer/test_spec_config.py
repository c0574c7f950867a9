"""SpeculativeConfig: the vLLM speculative_config schema and every rule of docs/reference.md §1."""

import dataclasses
import json

import pytest
from omegaconf import OmegaConf

from infer.spec_config import METHODS, REJECTION_SAMPLE_METHODS, SpeculativeConfig

NUM_TOKENS_TEXT = "Expected num_speculative_tokens to be greater than zero"
EAGLE3_HUB = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"

# (input, expected attributes after resolution)
GOOD = [
    ({"method": "ngram", "num_speculative_tokens": 3},
     {"prompt_lookup_max": 5, "prompt_lookup_min": 5, "model": None}),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
     {"prompt_lookup_max": 4, "prompt_lookup_min": 4}),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
     {"prompt_lookup_max": 2, "prompt_lookup_min": 2}),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
      "prompt_lookup_max": 6}, {"prompt_lookup_max": 6, "prompt_lookup_min": 2}),
    ({"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": 0},
     {"suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_tree_depth": 24}),
    ({"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_spec_factor": 2,
      "suffix_decoding_min_token_prob": 0, "suffix_decoding_max_tree_depth": 32},
     {"suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.0,
      "suffix_decoding_max_tree_depth": 32}),
    ({"method": "eagle3", "model": EAGLE3_HUB, "num_speculative_tokens": 3},
     {"method": "eagle3", "rejection_sample_method": "strict", "parallel_drafting": False}),
    ({"method": "eagle", "model": "some/head", "num_speculative_tokens": 5}, {"method": "eagle"}),
    ({"method": "draft_model", "model": "amd/PARD-Llama-3.2-1B", "num_speculative_tokens": 8,
      "parallel_drafting": True}, {"method": "draft_model", "parallel_drafting": True}),
    ({"method": "eagle3", "model": "h", "num_speculative_tokens": 4, "parallel_drafting": True},
     {"parallel_drafting": True}),
    ({"method": "mtp", "num_speculative_tokens": 1}, {"model": None}),
    ({"method": "mlp_speculator", "model": "ibm/spec", "num_speculative_tokens": 3},
     {"method": "mlp_speculator"}),
    ({"method": "medusa", "model": "FasterDecoding/medusa", "num_speculative_tokens": 4},
     {"method": "medusa"}),
    ({"method": "eagle", "model": "h", "num_speculative_tokens": 2,
      "rejection_sample_method": "probabilistic"},
     {"rejection_sample_method": "probabilistic", "draft_sample_method": "probabilistic"}),
    # vLLM's newer spelling: "standard" plus how drafts are made
    ({"method": "eagle", "model": "h", "num_speculative_tokens": 2,
      "rejection_sample_method": "standard", "draft_sample_method": "probabilistic"},
     {"rejection_sample_method": "probabilistic", "draft_sample_method": "probabilistic"}),
    ({"method": "eagle", "model": "h", "num_speculative_tokens": 2,
      "rejection_sample_method": "standard"},
     {"rejection_sample_method": "strict", "draft_sample_method": "greedy"}),
    ({"method": "eagle", "model": "h", "num_speculative_tokens": 2,
      "draft_sample_method": "probabilistic"}, {"rejection_sample_method": "probabilistic"}),
    ({"method": "eagle", "model": "h", "num_speculative_tokens": 2,
      "rejection_sample_method": "probabilistic", "draft_sample_method": "greedy"},
     {"rejection_sample_method": "strict"}),  # one-hot drafts: the same law as strict
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rate": 0.5, "draft_sample_method": "probabilistic"},
     {"rejection_sample_method": "synthetic", "draft_sample_method": "probabilistic"}),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rate": 0}, {"synthetic_acceptance_rate": 0.0}),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rate": 1}, {"synthetic_acceptance_rate": 1.0}),
    ({"method": "eagle3", "model": "h", "num_speculative_tokens": 3,
      "draft_tensor_parallel_size": 1, "max_model_len": 2048, "revision": "main"},
     {"draft_tensor_parallel_size": 1, "max_model_len": 2048, "revision": "main"}),
    # method inferred from a hub id's name (no local config.json)
    ({"model": EAGLE3_HUB, "num_speculative_tokens": 3}, {"method": "eagle3"}),
    ({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 3},
     {"method": "eagle"}),
    ({"model": "amd/PARD-Llama-3.2-1B", "num_speculative_tokens": 8, "parallel_drafting": True},
     {"method": "draft_model"}),
    # only the checkpoint's own name counts, not its organisation
    ({"model": "eagle-lab/llama-68m", "num_speculative_tokens": 3}, {"method": "draft_model"}),
]

# (input, substrings the error must contain: the key, the value and what is allowed)
BAD = [
    ({}, ["'method'", "'model'", "None"]),
    ({"num_speculative_tokens": 3}, ["'method'", "'model'"]),
    ({"method": "lookahead", "num_speculative_tokens": 3},
     ["'method'", "'lookahead'", "ngram, ngram_gpu, suffix, draft_model, eagle, eagle3, dflash"]),
    ({"method": "eagle3", "num_speculative_tokens": 3}, ["'model'", "None", "eagle3"]),
    ({"method": "eagle", "num_speculative_tokens": 3}, ["'model'", "'eagle'"]),
    ({"method": "draft_model", "num_speculative_tokens": 3}, ["'model'", "'draft_model'"]),
    ({"method": "mlp_speculator", "num_speculative_tokens": 3}, ["'model'", "'mlp_speculator'"]),
    ({"method": "medusa", "num_speculative_tokens": 3}, ["'model'", "'medusa'"]),
    ({"method": "ngram", "model": "m", "num_speculative_tokens": 3}, ["'model'", "'m'", "None"]),
    ({"method": "eagle3", "model": "", "num_speculative_tokens": 3},
     ["'model'", "''", "non-empty string"]),
    ({"method": "eagle3", "model": 7, "num_speculative_tokens": 3}, ["'model'", "7", "string"]),
    ({"method": "ngram", "num_speculative_tokens": 0}, [NUM_TOKENS_TEXT, "0"]),
    ({"method": "ngram", "num_speculative_tokens": -2}, [NUM_TOKENS_TEXT, "-2"]),
    ({"method": "ngram", "num_speculative_tokens": "3"},
     ["'num_speculative_tokens'", "'3'", "an integer"]),
    ({"method": "ngram", "num_speculative_tokens": True},
     ["'num_speculative_tokens'", "True", "an integer"]),
    ({"method": "ngram"}, ["'num_speculative_tokens'", "None", "required"]),
    ({"method": "eagle3", "model": EAGLE3_HUB}, ["'num_speculative_tokens'", "n_predict"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
     ["'draft_tensor_parallel_size'", "2", "1 or None", "one device"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 0},
     ["'draft_tensor_parallel_size'", "0", ">= 1"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "tensor_parallel_size": 1},
     ["'tensor_parallel_size'", "draft_tensor_parallel_size"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "max_model_len": 0},
     ["'max_model_len'", "0", ">= 1"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "parallel_drafting": True},
     ["'parallel_drafting'", "True", "'ngram'", "draft_model, eagle, eagle3, mtp, dflash"]),
    ({"method": "ngram_gpu", "model": "m", "num_speculative_tokens": 3},
     ["'model'", "'ngram_gpu'", "loads no model"]),
    ({"method": "dflash", "num_speculative_tokens": 3}, ["'model'", "'dflash' needs one"]),
    ({"method": "mlp_speculator", "model": "m", "num_speculative_tokens": 3,
      "parallel_drafting": True}, ["'parallel_drafting'", "'mlp_speculator'"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "parallel_drafting": "yes"},
     ["'parallel_drafting'", "'yes'", "true or false"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "exact"},
     ["'rejection_sample_method'", "'exact'", "strict, probabilistic, block, synthetic, standard"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_sample_method": "stochastic"},
     ["'draft_sample_method'", "'stochastic'", "greedy, probabilistic"]),
    ({"method": "eagle", "model": "h", "num_speculative_tokens": 3,
      "rejection_sample_method": "strict", "draft_sample_method": "probabilistic"},
     ["'draft_sample_method'", "'probabilistic'", "never reads the draft distribution"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"},
     ["'synthetic_acceptance_rate'", "None", "required", "synthetic"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "synthetic_acceptance_rate": 0.5},
     ["'synthetic_acceptance_rate'", "0.5", "'strict'"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rate": 1.5}, ["'synthetic_acceptance_rate'", "1.5", "[0.0, 1.0]"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 6,
      "prompt_lookup_max": 5}, ["'prompt_lookup_min'", "6", "<= prompt_lookup_max (5)"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0},
     ["'prompt_lookup_max'", "0", ">= 1"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0},
     ["'prompt_lookup_min'", "0", ">= 1"]),
    ({"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 0},
     ["'suffix_decoding_max_tree_depth'", "0", ">= 1"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_tree_max_batch": 0},
     ["'draft_tree_max_batch'", "0", ">= 1"]),
    ({"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_cached_requests": -1},
     ["'suffix_decoding_max_cached_requests'", "-1", ">= 0"]),
    ({"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_spec_factor": 0},
     ["'suffix_decoding_max_spec_factor'", "0", "(0.0, inf]"]),
    ({"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_min_token_prob": 1.5},
     ["'suffix_decoding_min_token_prob'", "1.5", "[0.0, 1.0]"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "speculative_model": "x"},
     ["'speculative_model'", "allowed keys", "num_speculative_tokens", "parallel_drafting"]),
    ({"method": "ngram", "num_speculative_tokens": 3, "quantization": "fp8"},
     ["'quantization'", "allowed keys"]),
]

SAMPLING_KEYS = ["temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens",
                 "stop_token_ids", "ignore_eos", "n", "min_p", "repetition_penalty"]


@pytest.mark.parametrize("obj, expected", GOOD)
def test_good_configs(obj, expected):
    cfg = SpeculativeConfig.parse(obj)
    for key, value in expected.items():
        assert getattr(cfg, key) == value, key
    assert cfg.method in METHODS
    assert cfg.num_speculative_tokens == obj.get("num_speculative_tokens")


@pytest.mark.parametrize("obj, fragments", BAD)
def test_bad_configs(obj, fragments):
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.parse(obj)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize("key", SAMPLING_KEYS)
def test_sampling_keys_point_to_sampling_params(key):
    with pytest.raises(ValueError, match=rf"'{key}'.*sampling parameter.*SamplingParams"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, key: 1})


@pytest.mark.parametrize("k", [0, -1])
def test_num_speculative_tokens_error_text(k):
    with pytest.raises(ValueError, match=NUM_TOKENS_TEXT):
        SpeculativeConfig(method="ngram", num_speculative_tokens=k)


def test_method_tables():
    assert METHODS == ("ngram", "ngram_gpu", "suffix", "draft_model", "eagle", "eagle3",
                       "dflash", "dspark", "mlp_speculator", "mtp", "medusa")
    assert REJECTION_SAMPLE_METHODS == ("strict", "probabilistic", "block", "synthetic")


# ---- method and k from the draft's config.json ----------------------------------------------

def _draft_dir(root, name, config):
    path = root / name
    path.mkdir(parents=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (path / "config.json").write_text(text)
    return path


SPECULATORS_EAGLE3 = {
    "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
    "draft_vocab_size": 32000, "target_hidden_size": 64, "tie_word_embeddings": False,
    "transformer_layer_config": {"model_type": "llama", "hidden_size": 64, "vocab_size": 1000},
    "speculators_config": {
        "algorithm": "eagle3", "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5,
                              "accept_tolerance": 0.0, "verifier_accept_k": 1}],
        "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny"}},
    "speculators_version": "0.1.0",
}
MLP_SPECULATOR = {"model_type": "mlp_speculator",
                  "architectures": ["MLPSpeculatorPreTrainedModel"], "emb_dim": 64,
                  "inner_dim": 64, "n_predict": 4, "n_candidates": 4,
                  "top_k_tokens_per_head": [1, 1, 1, 1], "vocab_size": 1000,
                  "tie_weights": False, "scale_input": False}
MEDUSA = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": 64,
          "vocab_size": 1000, "num_heads": 5}
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "vocab_size": 1000}


def test_infer_speculators_eagle3(tmp_path):
    path = _draft_dir(tmp_path, "head", SPECULATORS_EAGLE3)
    cfg = SpeculativeConfig.parse({"model": str(path)})
    assert (cfg.method, cfg.num_speculative_tokens) == ("eagle3", 5)
    explicit = SpeculativeConfig.parse({"model": str(path), "num_speculative_tokens": 3})
    assert explicit.num_speculative_tokens == 3  # the user's k wins over the checkpoint's


def test_infer_peagle_is_eagle3_with_parallel_drafting(tmp_path):
    """vLLM maps a ``peagle`` speculators checkpoint to eagle3 + parallel drafting, whether the
    method is inferred or given."""
    path = _draft_dir(tmp_path, "head", {**SPECULATORS_EAGLE3, "speculators_model_type": "peagle",
                                         "mask_token_id": 7})
    for given in ({"model": str(path)}, {"model": str(path), "method": "eagle3"}):
        cfg = SpeculativeConfig.parse(given)
        assert (cfg.method, cfg.parallel_drafting, cfg.num_speculative_tokens) == \
            ("eagle3", True, 5)
        assert SpeculativeConfig.parse(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="'peagle'.*not 'eagle'|declares a 'eagle3'"):
        SpeculativeConfig.parse({"model": str(path), "method": "eagle"})


def test_infer_dflash(tmp_path):
    path = _draft_dir(tmp_path, "block", {**SPECULATORS_EAGLE3, "speculators_model_type": "dflash"})
    cfg = SpeculativeConfig.parse({"model": str(path)})
    assert (cfg.method, cfg.num_speculative_tokens) == ("dflash", 5)


def test_ngram_gpu_mirrors_ngram():
    cfg = SpeculativeConfig.parse({"method": "ngram_gpu", "num_speculative_tokens": 3,
                                   "prompt_lookup_max": 4})
    assert (cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (4, 4)


def test_speculators_tokens_with_explicit_method(tmp_path):
    path = _draft_dir(tmp_path, "head", SPECULATORS_EAGLE3)
    cfg = SpeculativeConfig(method="eagle3", model=str(path))
    assert cfg.num_speculative_tokens == 5


def test_infer_mlp_speculator_n_predict(tmp_path):
    path = _draft_dir(tmp_path, "spec", MLP_SPECULATOR)
    cfg = SpeculativeConfig.parse({"model": str(path)})
    assert (cfg.method, cfg.num_speculative_tokens) == ("mlp_speculator", 4)


def test_infer_medusa(tmp_path):
    path = _draft_dir(tmp_path, "heads", MEDUSA)
    cfg = SpeculativeConfig.parse({"model": str(path), "num_speculative_tokens": 3})
    assert cfg.method == "medusa"
    with pytest.raises(ValueError, match="'num_speculative_tokens'.*required"):
        SpeculativeConfig.parse({"model": str(path)})


MIMO = {"architectures": ["MiMoForCausalLM"], "model_type": "mimo",
        "num_nextn_predict_layers": 2}


def test_mtp_rules_from_the_target_config(tmp_path, caplog):
    """vLLM's mtp rules: k defaults to num_nextn_predict_layers (n), k > n must be a multiple
    of n, a target without MTP layers is refused, the deprecated aliases warn and become mtp."""
    path = str(_draft_dir(tmp_path, "mimo", MIMO))
    cfg = SpeculativeConfig.parse({"method": "mtp", "model": path})
    assert cfg.num_speculative_tokens == 2 and SpeculativeConfig.parse(cfg.to_dict()) == cfg
    for k in (1, 2, 4, 6):
        assert SpeculativeConfig(method="mtp", model=path, num_speculative_tokens=k) \
            .num_speculative_tokens == k
    with pytest.raises(ValueError, match=r"'num_speculative_tokens'.*3.*multiple of 2"):
        SpeculativeConfig(method="mtp", model=path, num_speculative_tokens=3)
    with caplog.at_level("WARNING", logger="infer.spec_config"):
        alias = SpeculativeConfig.parse({"method": "mimo_mtp", "model": path})
    assert alias == cfg and "`mimo_mtp` is deprecated and replaced with mtp" in caplog.text
    plain = _draft_dir(tmp_path, "llama", LLAMA)
    with pytest.raises(ValueError, match="native MTP layers.*num_nextn_predict_layers: None"):
        SpeculativeConfig.parse({"method": "mtp", "model": str(plain)})


def test_infer_plain_llama_is_draft_model(tmp_path):
    # the directories above the checkpoint do not count, only its own name
    path = _draft_dir(tmp_path / "eagle3-runs", "llama-68m", LLAMA)
    cfg = SpeculativeConfig.parse({"model": str(path), "num_speculative_tokens": 4})
    assert cfg.method == "draft_model"
    with pytest.raises(ValueError, match="'num_speculative_tokens'.*required.*'draft_model'"):
        SpeculativeConfig.parse({"model": str(path)})


@pytest.mark.parametrize("name, method", [("my-EAGLE3-head", "eagle3"),
                                          ("Eagle-LLaMA3-head", "eagle"),
                                          ("llama-eagle3", "eagle3")])
def test_infer_from_directory_name(tmp_path, name, method):
    path = _draft_dir(tmp_path, name, LLAMA)
    assert SpeculativeConfig.parse({"model": str(path), "num_speculative_tokens": 3}).method \
        == method


def test_model_may_name_config_json(tmp_path):
    path = _draft_dir(tmp_path, "head", SPECULATORS_EAGLE3) / "config.json"
    cfg = SpeculativeConfig.parse({"model": str(path)})
    assert (cfg.method, cfg.num_speculative_tokens) == ("eagle3", 5)


def test_directory_without_config_uses_name(tmp_path):
    path = tmp_path / "EAGLE3-empty"
    path.mkdir()
    assert SpeculativeConfig(model=str(path), num_speculative_tokens=2).method == "eagle3"


def test_invalid_draft_config_json_names_file(tmp_path):
    path = _draft_dir(tmp_path, "broken", "{not json")
    with pytest.raises(ValueError, match=r"broken/config\.json .*is not valid JSON"):
        SpeculativeConfig.parse({"model": str(path)})
    path = _draft_dir(tmp_path, "listy", "[1, 2]")
    with pytest.raises(ValueError, match=r"listy/config\.json.*expected a JSON object"):
        SpeculativeConfig.parse({"model": str(path)})


def test_bad_values_in_draft_config(tmp_path):
    unknown = dict(SPECULATORS_EAGLE3, speculators_model_type="independent")
    path = _draft_dir(tmp_path, "a", unknown)
    with pytest.raises(ValueError, match=r"a/config\.json.*'speculators_model_type'.*"
                                         r"'independent'.*eagle3"):
        SpeculativeConfig.parse({"model": str(path)})
    path = _draft_dir(tmp_path, "b", dict(MLP_SPECULATOR, n_predict=0))
    with pytest.raises(ValueError, match=r"b/config\.json.*'n_predict': 0; expected an integer"):
        SpeculativeConfig.parse({"model": str(path)})


# ---- input forms ----------------------------------------------------------------------------

def test_parse_none_and_existing():
    assert SpeculativeConfig.parse(None) is None
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert SpeculativeConfig.parse(cfg) is cfg


def test_parse_json_string():
    text = '{"method": "eagle3", "model": "h", "num_speculative_tokens": 3}'
    assert SpeculativeConfig.parse(text) == SpeculativeConfig(method="eagle3", model="h",
                                                              num_speculative_tokens=3)
    assert SpeculativeConfig.parse("null") is None


@pytest.mark.parametrize("text, fragment", [("{method: ngram}", "not valid JSON"),
                                            ("", "not valid JSON"),
                                            ('"ngram"', "expected a JSON object"),
                                            ("[1, 2]", "expected a mapping")])
def test_parse_bad_json_string(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        SpeculativeConfig.parse(text)


@pytest.mark.parametrize("obj", [3, ["ngram"], 1.5])
def test_parse_wrong_type(obj):
    with pytest.raises(ValueError, match="expected a mapping"):
        SpeculativeConfig.parse(obj)


def test_parse_omegaconf():
    root = OmegaConf.create({"k": 4, "spec": {"method": "ngram", "num_speculative_tokens": "${k}",
                                              "prompt_lookup_max": 3}})
    cfg = SpeculativeConfig.parse(root.spec)
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min) == (4, 3)
    with pytest.raises(ValueError, match="'temperature'.*SamplingParams"):
        SpeculativeConfig.parse(OmegaConf.create({"method": "ngram", "temperature": 0.0}))


def test_kwargs_construction_validates_and_is_frozen():
    with pytest.raises(ValueError, match="'prompt_lookup_min'"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=9,
                          prompt_lookup_max=4)
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_speculative_tokens = 4
    assert dataclasses.replace(cfg, num_speculative_tokens=4).num_speculative_tokens == 4
    with pytest.raises(ValueError, match=NUM_TOKENS_TEXT):
        dataclasses.replace(cfg, num_speculative_tokens=0)


# ---- round trips and export -----------------------------------------------------------------

@pytest.mark.parametrize("obj", [good for good, _ in GOOD])
@pytest.mark.parametrize("full", [False, True])
def test_round_trip(obj, full):
    cfg = SpeculativeConfig.parse(obj)
    assert SpeculativeConfig.parse(cfg.to_dict(full=full)) == cfg
    assert SpeculativeConfig.parse(cfg.to_json(full=full)) == cfg
    assert hash(SpeculativeConfig.parse(cfg.to_json(full=full))) == hash(cfg)


def test_to_dict_is_minimal_and_resolved(tmp_path):
    cfg = SpeculativeConfig.parse({"model": EAGLE3_HUB, "num_speculative_tokens": 3})
    assert cfg.to_dict() == {"method": "eagle3", "model": EAGLE3_HUB, "num_speculative_tokens": 3}
    assert len(cfg.to_dict(full=True)) == len(dataclasses.fields(SpeculativeConfig))
    # a min alone would mirror into max on parse, so both are written
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2,
                            prompt_lookup_max=5)
    assert cfg.to_dict()["prompt_lookup_max"] == 5 and cfg.to_dict()["prompt_lookup_min"] == 2
    # inferred method and k are written out, so the export no longer needs the checkpoint
    path = _draft_dir(tmp_path, "spec", MLP_SPECULATOR)
    out = json.loads(SpeculativeConfig.parse({"model": str(path)}).to_json())
    assert out == {"method": "mlp_speculator", "model": str(path), "num_speculative_tokens": 4}


def test_resolved_against_the_target_once():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3, max_model_len=1024)
    assert cfg.for_target("t", 2048).max_model_len == 1024
    assert cfg.for_target("t", 1024).max_model_len == 1024
    with pytest.raises(ValueError, match=r"'max_model_len': 1024; expected .*<= .*\(512\)"):
        cfg.for_target("t", 512)
    unset = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert unset.for_target("t", 4096).max_model_len == 4096  # the target's (mtp's model:
    # tests/infer/proposers/test_mtp.py, where a target with MTP layers exists)


def test_speculative_token_map_is_an_eagle3_file_found_beside_the_head(tmp_path, monkeypatch):
    """draftsmith's (and SGLang's) key: an eagle3 head's only; a relative name that is not a file
    here is the draft directory's (where export writes it); resolved to a path, so a resolved
    config parses to itself; vLLM is never sent it."""
    from infer.foundation.errors import MissingFileError
    from infer.eval.vllm_engine import for_vllm

    head = _draft_dir(tmp_path, "head", SPECULATORS_EAGLE3)
    (head / "speculative_token_map.json").write_text('{"token_ids": [1, 2]}')
    monkeypatch.chdir(tmp_path)
    cfg = SpeculativeConfig.parse({"model": str(head),
                                   "speculative_token_map": "speculative_token_map.json"})
    assert cfg.speculative_token_map == str(head / "speculative_token_map.json")
    assert SpeculativeConfig.parse(cfg.to_dict()) == cfg
    assert "speculative_token_map" not in for_vllm(cfg)
    with pytest.raises(MissingFileError, match="speculative_token_map 'other.json'"):
        SpeculativeConfig.parse({"model": str(head), "speculative_token_map": "other.json"})
    with pytest.raises(ValueError, match="'speculative_token_map'.*'ngram'"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                 "speculative_token_map": "x.json"})
