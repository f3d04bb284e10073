#!/usr/bin/env python3
"""Writes tests/data/hf_tiny_llama/: a tiny random LlamaForCausalLM saved by transformers'
own save_pretrained (config.json + model.safetensors, untied head, a 200-token vocabulary that
Loom pads to 256, 4 query heads sharing 2 key/value heads, rope_theta 500), and
tests/data/hf_tiny_llama31/: the same sizes with a tied head and Llama 3.1's "llama3"
rope_scaling (factor 4, low/high frequency factors 1 and 4, original context 16, so that at
head size 8 one frequency stays, one is blended and two are divided), each with
loom_expected_logits.safetensors: a (2, 12) token batch and transformers' logits for it,
computed in float64 (LlamaForCausalLM returns them as float32). tests/checkpoint/export_test.cc starts a Loom Llama from the directory
(train.init_from's loader) and compares its logits.

With --mixtral instead: tests/data/hf_tiny_mixtral/, a MixtralForCausalLM of the same sizes with
4 experts (48 wide) per block, 2 per token, and its logits likewise. With --qwen2:
tests/data/hf_tiny_qwen2/, a Qwen2ForCausalLM of the same sizes (a tied head, rope_theta 1e6,
rms_norm_eps 1e-6, as Qwen 2.5's small models) whose q/k/v biases are random, not transformers'
zeros, so that a bias read wrongly shows in the logits (made with 4.40.2). With --qwen3:
tests/data/hf_tiny_qwen3/, a Qwen3ForCausalLM of the same sizes but heads 16 wide (head_dim:
queries 64 wide from a 32-wide model, as Qwen 3's 128-wide heads are wider than their share) with
random q_norm / k_norm gains (made with transformers 4.51.3 on Debian's torch 1.13 through
tools/torch1_shim.py). With --qwen3-moe: tests/data/hf_tiny_qwen3_moe/, that Qwen 3 with a
mixture of 4 experts 24 wide in each block, 2 per token, norm_topk_prob true
(Qwen3MoeForCausalLM, 4.51.3). With --mistral: tests/data/hf_tiny_mistral/, a
MistralForCausalLM of hf_tiny_llama's sizes with a sliding window of 5 positions (transformers
4.51.3, which counts the query's own position among the 5; 4.40 counted one more). With
--olmo2: tests/data/hf_tiny_olmo2/, an Olmo2ForCausalLM of hf_tiny_llama's sizes (an untied head,
rope_theta 500, rms_norm_eps 1e-6): norms after the attention and the MLP, and q_norm / k_norm
over all the query heads (32 wide) and all the key heads (16 wide), their gains random
(transformers 4.51.3). With --gemma3: tests/data/hf_tiny_gemma3/, a Gemma3ForCausalLM (text) of
hf_tiny_llama's widths but 3 blocks, heads 16 wide (head_dim, query_pre_attn_scalar 16), a tied
head, sandwich norms and per-head q_norm / k_norm with random gains (Gemma's w, around zero),
GeGLU, the embedding times √32, a sliding window of 5 in blocks 0 and 1 (sliding_window_pattern
3) turned by rope_local_base_freq 10 000, block 2 whole and turned by rope_theta 1e6
(transformers 4.51.3; run without its cache, which needs torch 2). With --gemma3-mm:
tests/data/hf_tiny_gemma3_mm/, Gemma 3 4B+'s form: that text model with linear rope scaling
(factor 8, the whole-sequence blocks only) and 27B's query_pre_attn_scalar apart from head_dim
(24 for heads of 16) inside a Gemma3ForConditionalGeneration beside a
one-block SigLIP vision tower (its tensors named language_model.model.*, vision_tower.*,
multi_modal_projector.*), its logits those of a text-only batch. With --olmoe:
tests/data/hf_tiny_olmoe/, an OlmoeForCausalLM of hf_tiny_llama's sizes (an untied head, rope_theta
500) with 4 experts 24 wide in each block, 2 per token, their weights not normalised over the
chosen (norm_topk_prob false, OLMoE's), and q_norm / k_norm over all the query heads (32 wide)
and all the key heads (16 wide) with random gains (transformers 4.51.3). With --phi3:
tests/data/hf_tiny_phi3/, a Phi3ForCausalLM of hf_tiny_llama's sizes (Phi-3's and Phi-4's class:
the queries, keys and values in one qkv_proj, the gate and up rows in one gate_up_proj) with a
sliding window of 5 positions (Phi-3-mini's 2047, as transformers 4.51.3 counts it).

    EXTRA_PYTHONPATH=DIR /usr/bin/python3 tools/make_hf_llama_fixture.py \
        [--mixtral|--qwen2|--qwen3|--qwen3-moe|--mistral|--olmo2]

Needs torch, numpy and transformers >= 4.43 for rope_scaling "llama3" (made with 4.44.2 on
Debian's torch 1.13; the Mixtral with 4.40.2).
"""
import os
import sys

if os.environ.get("EXTRA_PYTHONPATH"):
    sys.path.append(os.environ["EXTRA_PYTHONPATH"])

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch1_shim  # noqa: E402,F401  (before transformers)
from torch_reference import save_safetensors  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,  # noqa: E402
                          Qwen2Config, Qwen2ForCausalLM)


def write(name, tied, rope_scaling, experts=0, qwen2=False, qwen3=False,  # noqa: C901
          window=None, olmo2=False, gemma3=False, gemma3_mm=False, olmoe=False, phi3=False):
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", name)
    torch.manual_seed(7)
    sizes = dict(vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=tied, initializer_range=0.2)
    if gemma3:
        from transformers import (Gemma3Config, Gemma3ForCausalLM,  # transformers >= 4.50
                                  Gemma3ForConditionalGeneration, Gemma3TextConfig)
        sizes.update(num_hidden_layers=3, rms_norm_eps=1e-6, rope_theta=1e6)
        text = dict(**sizes, head_dim=16, query_pre_attn_scalar=16, rope_local_base_freq=10000.0,
                    sliding_window=5, sliding_window_pattern=3)
        if gemma3_mm:  # Gemma 3 4B+'s form: a vision tower beside the text model, linear rope,
            # and (27B's) the scores scaled by 1/√24, not 1/√head_dim
            text.update(rope_scaling={"rope_type": "linear", "factor": 8.0},
                        query_pre_attn_scalar=24)
            config = Gemma3Config(text_config=text, mm_tokens_per_image=1,
                                  vision_config=dict(hidden_size=16, intermediate_size=32,
                                                     num_hidden_layers=1, num_attention_heads=2,
                                                     image_size=28, patch_size=14),
                                  attn_implementation="eager")
            model = Gemma3ForConditionalGeneration(config).eval()
            text_model = model.language_model.model
        else:
            config = Gemma3TextConfig(**text, attn_implementation="eager")
            model = Gemma3ForCausalLM(config).eval()
            text_model = model.model
        with torch.no_grad():  # Gemma's gains are 1 + w, w zero at first: every w random
            for layer in text_model.layers:
                for norm in (layer.input_layernorm, layer.post_attention_layernorm,
                             layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm,
                             layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.add_(0.3 * torch.randn(norm.weight.shape))
            text_model.norm.weight.add_(0.3 * torch.randn(32))
    elif olmoe:
        from transformers import OlmoeConfig, OlmoeForCausalLM  # transformers >= 4.45
        model = OlmoeForCausalLM(OlmoeConfig(**{**sizes, "intermediate_size": 24},
                                             num_experts=experts, num_experts_per_tok=2,
                                             norm_topk_prob=False, attn_implementation="eager")).eval()
        with torch.no_grad():  # the full-width query/key norms' gains away from one
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.add_(0.3 * torch.randn(32))
                layer.self_attn.k_norm.weight.add_(0.3 * torch.randn(16))
    elif olmo2:
        from transformers import Olmo2Config, Olmo2ForCausalLM  # transformers >= 4.47
        sizes.update(rms_norm_eps=1e-6)
        model = Olmo2ForCausalLM(Olmo2Config(**sizes, attn_implementation="eager")).eval()
        with torch.no_grad():  # every gain away from one, so a gain read wrongly shows
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.add_(0.3 * torch.randn(32))
                layer.self_attn.k_norm.weight.add_(0.3 * torch.randn(16))
                layer.post_attention_layernorm.weight.add_(0.3 * torch.randn(32))
                layer.post_feedforward_layernorm.weight.add_(0.3 * torch.randn(32))
    elif phi3:
        from transformers import Phi3Config, Phi3ForCausalLM  # transformers >= 4.40
        config = Phi3Config(**sizes, sliding_window=window, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, attn_implementation="eager")
        model = Phi3ForCausalLM(config).eval()
    elif window:
        from transformers import MistralConfig, MistralForCausalLM
        config = MistralConfig(**sizes, sliding_window=window, attn_implementation="eager")
        model = MistralForCausalLM(config).eval()
    elif qwen3:
        from transformers import (Qwen3Config, Qwen3ForCausalLM,  # transformers >= 4.51
                                  Qwen3MoeConfig, Qwen3MoeForCausalLM)
        sizes.update(rope_theta=1e6, rms_norm_eps=1e-6)
        if experts:
            config = Qwen3MoeConfig(**sizes, head_dim=16, use_sliding_window=False,
                                    num_experts=experts, num_experts_per_tok=2,
                                    moe_intermediate_size=24, norm_topk_prob=True,
                                    decoder_sparse_step=1, mlp_only_layers=[],
                                    attn_implementation="eager")
            model = Qwen3MoeForCausalLM(config).eval()
        else:
            config = Qwen3Config(**sizes, head_dim=16, use_sliding_window=False,
                                 attn_implementation="eager")
            model = Qwen3ForCausalLM(config).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.add_(0.3 * torch.randn(16))
                layer.self_attn.k_norm.weight.add_(0.3 * torch.randn(16))
    elif qwen2:
        sizes.update(rope_theta=1e6, rms_norm_eps=1e-6)
        model = Qwen2ForCausalLM(Qwen2Config(**sizes, use_sliding_window=False)).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.copy_(0.5 * torch.randn(proj.bias.shape))
    elif experts:
        config = MixtralConfig(**sizes, num_local_experts=experts, num_experts_per_tok=2,
                               sliding_window=None)
        model = MixtralForCausalLM(config).eval()
    else:
        model = LlamaForCausalLM(LlamaConfig(**sizes, rope_scaling=rope_scaling)).eval()
    with torch.no_grad():  # norm gains away from one, so a wrong gain would show
        for layer in model.model.layers if not (olmo2 or gemma3) else []:  # (OLMoE's too)
            layer.input_layernorm.weight.add_(0.3 * torch.randn(32))
            layer.post_attention_layernorm.weight.add_(0.3 * torch.randn(32))
        if not gemma3:
            model.model.norm.weight.add_(0.3 * torch.randn(32))
    model.save_pretrained(out, safe_serialization=True)
    tokens = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(3))
    # Mixtral's causal mask (transformers 4.40) is made in the default dtype from the model's
    # dtype's minimum: float64 must be the default while the float64 model runs.
    torch.set_default_dtype(torch.float64)
    with torch.no_grad():
        logits = model.double()(input_ids=tokens, use_cache=False).logits
    torch.set_default_dtype(torch.float32)
    save_safetensors(os.path.join(out, "loom_expected_logits.safetensors"),
                     {"tokens": tokens.numpy().astype(np.int32),
                      "logits": logits.float().numpy()},  # 4.40 returns float32, 4.51 float64
                     {"source": "tools/make_hf_llama_fixture.py"})
    print("wrote", out)


def main():
    if sys.argv[1:] == ["--mixtral"]:
        write("hf_tiny_mixtral", tied=False, rope_scaling=None, experts=4)
        return
    if sys.argv[1:] == ["--qwen2"]:
        write("hf_tiny_qwen2", tied=True, rope_scaling=None, qwen2=True)
        return
    if sys.argv[1:] == ["--qwen3"]:
        write("hf_tiny_qwen3", tied=True, rope_scaling=None, qwen3=True)
        return
    if sys.argv[1:] == ["--mistral"]:
        write("hf_tiny_mistral", tied=False, rope_scaling=None, window=5)
        return
    if sys.argv[1:] == ["--gemma3"]:
        write("hf_tiny_gemma3", tied=True, rope_scaling=None, gemma3=True)
        return
    if sys.argv[1:] == ["--gemma3-mm"]:
        write("hf_tiny_gemma3_mm", tied=True, rope_scaling=None, gemma3=True, gemma3_mm=True)
        return
    if sys.argv[1:] == ["--phi3"]:
        write("hf_tiny_phi3", tied=False, rope_scaling=None, window=5, phi3=True)
        return
    if sys.argv[1:] == ["--olmoe"]:
        write("hf_tiny_olmoe", tied=False, rope_scaling=None, experts=4, olmoe=True)
        return
    if sys.argv[1:] == ["--olmo2"]:
        write("hf_tiny_olmo2", tied=False, rope_scaling=None, olmo2=True)
        return
    if sys.argv[1:] == ["--qwen3-moe"]:
        write("hf_tiny_qwen3_moe", tied=True, rope_scaling=None, qwen3=True, experts=4)
        return
    write("hf_tiny_llama", tied=False, rope_scaling=None)
    write("hf_tiny_llama31", tied=True,
          rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})


if __name__ == "__main__":
    main()
