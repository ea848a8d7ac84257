"""The model families ppoflow builds tiny checkpoints of (rl_core.models.tiny) and is tested on: every one loads through
the same pipeline and trains. A plain table (no imports), so that the command line can list them at once."""

# family -> (transformers model_type, the settings a tiny model of it needs beyond the shared sizes)
FAMILIES = {
    "qwen2": ("qwen2", {}),
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3_text", {}),
    "phi3": ("phi3", {}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}

# the vision-language families (rl_core.models.tiny_vlm): transformers' image-text-to-text models, loaded by the same
# pipeline
VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava")
