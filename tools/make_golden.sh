#!/usr/bin/env bash
# Regenerates the golden files of the reference tests:
#   tools/make_golden.sh        tests/data/gpt2_reference_golden.safetensors (PyTorch GPT-2)
#   tools/make_golden.sh llama  tests/data/llama_reference_golden.safetensors (transformers'
#                               LlamaForCausalLM)
#   tools/make_golden.sh moe    tests/data/moe_reference_golden.safetensors (transformers'
#                               MixtralForCausalLM)
#   tools/make_golden.sh qwen2  tests/data/qwen2_reference_golden.safetensors (transformers'
#                               Qwen2ForCausalLM)
#   tools/make_golden.sh qwen3  tests/data/qwen3_reference_golden.safetensors (transformers'
#                               Qwen3ForCausalLM: transformers >= 4.51)
#   tools/make_golden.sh olmo2  tests/data/olmo2_reference_golden.safetensors (transformers'
#                               Olmo2ForCausalLM: transformers >= 4.47)
#   tools/make_golden.sh gemma3 tests/data/gemma3_reference_golden.safetensors (transformers'
#                               Gemma3ForCausalLM: transformers >= 4.50)
# Needs a release build and PyTorch (apt-get install python3-torch, or pip install torch); llama
# and moe also transformers (pip install transformers; EXTRA_PYTHONPATH for a pip --target install).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build --preset release --target loom_export_reference
tmp=$(mktemp -d)
if [ "${1:-gpt2}" = moe ]; then
  ./build/release/tools/loom_export_reference --moe "$tmp/init.safetensors"
  "${PYTHON:-python3}" tools/hf_mixtral_reference.py "$tmp/init.safetensors" tests/data/moe_reference_golden.safetensors
elif [ "${1:-gpt2}" = qwen3 ]; then
  ./build/release/tools/loom_export_reference --qwen3 "$tmp/init.safetensors"
  "${PYTHON:-python3}" tools/hf_llama_reference.py "$tmp/init.safetensors" tests/data/qwen3_reference_golden.safetensors
elif [ "${1:-gpt2}" = gemma3 ]; then
  ./build/release/tools/loom_export_reference --gemma3 "$tmp/init.safetensors"
  "${PYTHON:-python3}" tools/hf_llama_reference.py "$tmp/init.safetensors" tests/data/gemma3_reference_golden.safetensors
elif [ "${1:-gpt2}" = olmo2 ]; then
  ./build/release/tools/loom_export_reference --olmo2 "$tmp/init.safetensors"
  "${PYTHON:-python3}" tools/hf_llama_reference.py "$tmp/init.safetensors" tests/data/olmo2_reference_golden.safetensors
elif [ "${1:-gpt2}" = qwen2 ]; then
  ./build/release/tools/loom_export_reference --qwen2 "$tmp/init.safetensors"
  "${PYTHON:-python3}" tools/hf_llama_reference.py "$tmp/init.safetensors" tests/data/qwen2_reference_golden.safetensors
elif [ "${1:-gpt2}" = llama ]; then
  ./build/release/tools/loom_export_reference --llama "$tmp/init.safetensors"
  "${PYTHON:-python3}" tools/hf_llama_reference.py "$tmp/init.safetensors" tests/data/llama_reference_golden.safetensors
else
  ./build/release/tools/loom_export_reference "$tmp/init.safetensors"
  "${PYTHON:-python3}" tools/torch_reference.py "$tmp/init.safetensors" tests/data/gpt2_reference_golden.safetensors
fi
rm -rf "$tmp"
