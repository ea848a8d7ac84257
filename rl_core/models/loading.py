"""Loading a Hugging Face checkpoint the way verl does, from a local folder only.

    tokenizer -> AutoConfig (+ override_config, dropout off) -> model class detection -> attention kernels
    -> from_pretrained (dtype) -> tokenizer vs embedding -> generation defaults reset -> optional gradient
    checkpointing -> optional LoRA (peft)

Model class detection: a config with ``auto_map`` names remote code, used only with ``trust_remote_code``;
otherwise the Hugging Face auto-class mappings are searched in order CausalLM, Vision2Seq, ImageTextToText.
``external_lib`` is imported first so that a user module can register its own classes with the auto classes.

What RL needs of a model that pretraining checkpoints do not give, set here and reported as a
:class:`ModelLoadWarning` (the workers send those to the controller's log):

* dropout off (every ``*dropout*`` / ``*pdrop`` probability of the config is 0 unless ``override_config`` sets it):
  with dropout the update's forward pass and the old log-probs' differ, and the PPO ratio is noise;
* attention kernels the architecture has: flash-attention 2 (on CUDA, half precision, ``flash_attn`` installed), else
  PyTorch's SDPA (over a packed sequence, its rows as padded batches: :mod:`rl_core.models.packed_attention`), else
  eager, or ``override_config.attn_implementation``;
* plain generation defaults: a checkpoint's ``generation_config.json`` (Qwen2.5-Instruct's repetition penalty, its
  temperature, top-p) would change how the rollout samples; only its token ids are kept;
* a tokenizer with more tokens than the embedding has rows (:mod:`rl_core.models.vocabulary`): said once, with both
  sizes; refused when a special token lies past the rows;
* what a load makes anew (a critic's value head, LoRA's adapters, weights a checkpoint lacks) drawn from one fixed
  seed (:func:`seeded_init`), so that a run repeats.

Every loader passes :data:`NO_HUB_KERNELS`: with the ``kernels`` package installed (a dependency of transformers 5),
``from_pretrained`` would swap layers (RMSNorm, activations, RoPE on CUDA) for kernels it downloads from the Hugging
Face Hub and runs (remote code without ``trust_remote_code``), and would re-kernelize at every ``train()`` or
``eval()`` switch (~0.2 ms each on the CPU, a rollout and an update per step).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from rl_core.device import COMPUTE_DTYPES
from rl_core.models.checkpointing import apply_gradient_checkpointing
from rl_core.models.folder import ModelLoadError, local_model_path
from rl_core.models.logprob import padding_free_mismatch
from rl_core.models.vocabulary import describe_ids, fed_ids, ids_past_rows, model_rows

if TYPE_CHECKING:  # the modeling code imports in seconds: only the workers need it, when they load a model
    from transformers import PreTrainedModel


DTYPES = {name: dtype for name, dtype in COMPUTE_DTYPES.items() if dtype is not None}  # a stored dtype: no "auto"
# (auto_map key, transformers auto class name) in the order they are tried; classes missing from this
# transformers release (AutoModelForVision2Seq was folded into ImageTextToText in v5) are skipped.
GENERATIVE_AUTO_CLASSES = (
    ("AutoModelForCausalLM", "AutoModelForCausalLM"),
    ("AutoModelForVision2Seq", "AutoModelForVision2Seq"),
    ("AutoModelForImageTextToText", "AutoModelForImageTextToText"),
)
# attention implementations in order of preference, with the class attribute saying that an architecture has it
ATTENTION_SUPPORT = {
    "flash_attention_2": ("_supports_flash_attn", "_supports_flash_attn_2"),
    "sdpa": ("_supports_sdpa",),
    "eager": (),
}
NO_HUB_KERNELS = {"use_kernels": False}  # see the module doc
# generation_config.json fields that are not sampling settings (kept: they say which tokens end or pad a sequence)
GENERATION_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
# ... nor are these (what generate returns, caching, bookkeeping): dropped without a word
GENERATION_NON_SAMPLING_PREFIXES = ("_", "transformers_version", "output_", "return_dict", "use_cache", "cache_")


class ModelLoadWarning(UserWarning):
    """Something a worker changed or could not use while it loaded its model (a checkpoint's dropout or generation
    defaults, an attention fallback, a policy loss of verl's legacy form): reported once, at load."""


def import_external_lib(module_name: str | None) -> None:
    """Import ``model.external_lib`` so that its custom model classes register themselves."""
    if not module_name:
        return
    try:
        importlib.import_module(module_name)
    except ImportError as error:
        raise ModelLoadError(
            f"model.external_lib={module_name!r} could not be imported ({error}); install it or fix the module name"
        ) from error


def load_tokenizer(
    path: str, trust_remote_code: bool = False, custom_chat_template: str | None = None
) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, left-padded (prompts are left-padded for generation), with a pad token."""
    folder = local_model_path(path, "model.tokenizer_path")
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if custom_chat_template:
        tokenizer.chat_template = custom_chat_template
    return tokenizer


def load_hf_config(path: str, override_config: dict | None = None, trust_remote_code: bool = False) -> PretrainedConfig:
    """AutoConfig of the checkpoint with ``override_config`` applied (unknown keys are an error;
    ``attn_implementation`` is not a config field: :func:`attention_implementation` reads it) and dropout off."""
    folder = local_model_path(path)
    _check_remote_code(folder, trust_remote_code)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    overrides = {k: v for k, v in dict(override_config or {}).items() if k != "attn_implementation"}
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ModelLoadError(f"model.override_config.{key}: {type(config).__name__} has no attribute {key!r}")
        setattr(config, key, value)
    disable_dropout(config, keep=set(overrides))
    return config


def disable_dropout(config: PretrainedConfig, keep: set[str] = frozenset()) -> dict[str, float]:
    """Set every dropout probability of ``config`` (and its sub-configs) to 0, except the keys in ``keep``; returns
    what was changed, which is also reported as a ModelLoadWarning."""
    changed = {}
    for sub in [config, *(v for v in vars(config).values() if isinstance(v, PretrainedConfig))]:
        for key, value in vars(sub).items():
            is_dropout = "dropout" in key or key.endswith("pdrop")
            if (
                is_dropout
                and key not in keep
                and isinstance(value, float)
                and not isinstance(value, bool)
                and value > 0
            ):
                setattr(sub, key, 0.0)
                changed[key] = value
    if changed:
        listed = ", ".join(f"{k}={v}" for k, v in changed.items())
        warnings.warn(
            ModelLoadWarning(
                f"dropout turned off for RL ({listed} -> 0): with dropout the PPO ratio of the update's forward pass "
                "is noise; set it in model.override_config to keep it"
            ),
            stacklevel=2,
        )
    return changed


def _check_remote_code(folder: Path, trust_remote_code: bool) -> None:
    import json

    auto_map = json.loads((folder / "config.json").read_text()).get("auto_map")
    if auto_map and not trust_remote_code:
        raise ModelLoadError(
            f"{folder} ships its own model code (config.json auto_map: {sorted(auto_map)}); running it needs "
            "model.trust_remote_code=true — only set that for checkpoints whose code you trust"
        )


def resolve_model_class(config: PretrainedConfig, trust_remote_code: bool = False) -> type[PreTrainedModel]:
    """The generative model class for ``config``: remote code from ``auto_map``, else the HF auto-class mappings."""
    auto_map = getattr(config, "auto_map", None) or {}
    for auto_map_key, auto_class_name in GENERATIVE_AUTO_CLASSES:
        if auto_map_key in auto_map:
            if not trust_remote_code:
                raise ModelLoadError(
                    f"the model's {auto_map_key} is remote code ({auto_map[auto_map_key]}); set "
                    "model.trust_remote_code=true to run it"
                )
            return transformers.dynamic_module_utils.get_class_from_dynamic_module(
                auto_map[auto_map_key], config.name_or_path
            )
        auto_class = getattr(transformers, auto_class_name, None)
        if auto_class is not None and type(config) in auto_class._model_mapping:
            return auto_class._model_mapping[type(config)]
    raise ModelLoadError(
        f"architecture {type(config).__name__} (model_type={config.model_type!r}) is not a causal LM, Vision2Seq or "
        f"image-text-to-text model in transformers {transformers.__version__}; set model.external_lib to a module that "
        "registers it, or model.trust_remote_code=true if the checkpoint ships its code"
    )


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ModelLoadError(f"model.dtype={name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def load_policy_tokenizer(model_config: Any) -> PreTrainedTokenizerBase:
    """The policy's tokenizer (``tokenizer_path``, else ``path``) with ``custom_chat_template`` applied: the dataset's
    prompts and the rollout use the same template."""
    return load_tokenizer(
        model_config.tokenizer_path or model_config.path,
        bool(model_config.trust_remote_code),
        model_config.custom_chat_template,
    )


def load_policy_processor(model_config: Any, tokenizer: PreTrainedTokenizerBase) -> Any | None:
    """The policy's multimodal processor (:mod:`rl_core.models.processor`) with its ``tokenizer``, or None for a
    text-only checkpoint."""
    from rl_core.models.processor import load_processor

    return load_processor(
        local_model_path(model_config.tokenizer_path or model_config.path, "model.tokenizer_path"),
        tokenizer,
        bool(model_config.trust_remote_code),
        model_config.custom_chat_template,
    )


def has_attention(model_class: type, implementation: str) -> bool:
    """Whether ``model_class`` declares the attention ``implementation`` (eager attention: every model)."""
    flags = ATTENTION_SUPPORT[implementation]
    return not flags or any(getattr(model_class, flag, False) for flag in flags)


def attention_implementation(
    model_class: type | None,
    device: str = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    override_config: dict | None = None,
) -> str:
    """``override_config.attn_implementation`` when set; else the first ``model_class`` has of ``flash_attention_2``
    (variable-length kernels: the padding-free forward skips padding entirely; on CUDA with half-precision compute and
    the ``flash_attn`` package installed), ``sdpa`` (PyTorch's, as :data:`PACKED_SDPA`: a packed sequence's rows as
    padded batches) and ``eager``. Falling back to eager is reported. A class that is not known before loading (remote
    code) gets ``sdpa``."""
    requested = dict(override_config or {}).get("attn_implementation")
    if requested:
        return str(requested)
    if model_class is None:
        return "sdpa"
    candidates = ["sdpa", "eager"]
    if (
        device == "cuda"
        and compute_dtype in (torch.bfloat16, torch.float16)
        and importlib.util.find_spec("flash_attn") is not None
    ):
        candidates.insert(0, "flash_attention_2")
    candidate = next(c for c in candidates if has_attention(model_class, c))
    if candidate == "sdpa":
        from rl_core.models.packed_attention import PACKED_SDPA  # registers it with transformers

        return PACKED_SDPA
    if candidate == "eager":
        warnings.warn(
            ModelLoadWarning(
                f"{model_class.__name__} has no SDPA attention in transformers {transformers.__version__}: using eager "
                "attention (slower, more memory); model.override_config.attn_implementation chooses another"
            ),
            stacklevel=2,
        )
    return candidate


def reset_generation_config(model: PreTrainedModel) -> dict[str, Any]:
    """Replace the checkpoint's generation defaults by transformers' own (keeping the token ids): ``generate`` fills
    every
    setting it is not given from them. Returns the sampling settings that were dropped (also reported)."""
    loaded = model.generation_config.to_diff_dict()
    dropped = {
        k: v
        for k, v in loaded.items()
        if k not in GENERATION_TOKEN_FIELDS and not k.startswith(GENERATION_NON_SAMPLING_PREFIXES)
    }
    model.generation_config = GenerationConfig(**{k: loaded[k] for k in GENERATION_TOKEN_FIELDS if k in loaded})
    if dropped:
        listed = ", ".join(f"{k}={v}" for k, v in sorted(dropped.items()))
        warnings.warn(
            ModelLoadWarning(
                f"the checkpoint's generation_config.json sets {listed}: not used, the rollout samples with "
                "actor_rollout_ref.rollout.* only (the policy that is trained)"
            ),
            stacklevel=2,
        )
    return dropped


def load_policy_model(
    model_config: Any, device: str = "cpu", compute_dtype: torch.dtype = torch.float32, train_tokens: int | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The actor/ref model and tokenizer described by an ``actor_rollout_ref.model`` config node (on the CPU; the
    attention kernels are chosen for the ``device`` and ``compute_dtype`` it will run in). ``train_tokens``: the
    micro-batch token budget of a model that is trained (gradient checkpointing's null setting weighs it), None for
    one that is not."""
    path = model_config.path
    trust_remote_code = bool(model_config.trust_remote_code)
    import_external_lib(model_config.external_lib)
    tokenizer = load_policy_tokenizer(model_config)
    hf_config = load_hf_config(path, model_config.override_config, trust_remote_code)
    model_class = resolve_model_class(hf_config, trust_remote_code)
    attention = attention_implementation(model_class, device, compute_dtype, model_config.override_config)
    try:
        model = model_class.from_pretrained(
            local_model_path(path),
            config=hf_config,
            dtype=torch_dtype(model_config.dtype),
            trust_remote_code=trust_remote_code,
            attn_implementation=attention,
            **NO_HUB_KERNELS,
        )
    except (ValueError, ImportError) as error:
        if "attention" not in str(error) and "attn" not in str(error):
            raise
        raise ModelLoadError(
            f"{model_class.__name__} cannot load with attn_implementation={attention!r} "
            f"({str(error).splitlines()[0]}); set actor_rollout_ref.model.override_config.attn_implementation to one "
            "it has (eager always works)"
        ) from error
    check_model_vocabulary(model, tokenizer, "actor_rollout_ref.model.path")
    reset_generation_config(model)
    apply_gradient_checkpointing(model, model_config.enable_gradient_checkpointing, train_tokens, device, compute_dtype)
    return model, tokenizer


def check_model_vocabulary(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, setting: str) -> None:
    """The loaded ``model`` has a row for every id its LM head samples and for the tokenizer's special tokens (a
    ModelLoadError naming them otherwise); a tokenizer with more tokens than rows is reported with both sizes.
    ``ppoflow train`` checks the prompts and the template's tokens too, before it starts anything
    (``rl_core.input_checks``)."""
    rows, head_rows = model_rows(model)
    fix = "resize the model's embedding to the tokenizer (model.resize_token_embeddings(len(tokenizer))) and save it"
    if head_rows is not None and head_rows > rows:
        raise ModelLoadError(
            f"{setting}: the LM head samples {head_rows} ids but the input embedding has {rows} rows; {fix}"
        )
    if len(tokenizer) <= rows:
        return
    past = ids_past_rows(fed_ids(tokenizer, prompt_ids=(), multi_turn=False), rows)  # the special tokens
    if past:
        raise ModelLoadError(
            f"{setting}: token id(s) past the model's embedding: {describe_ids(tokenizer, past)}; the tokenizer has "
            f"{len(tokenizer)} tokens, the embedding {rows} rows; {fix}"
        )
    extra = tokenizer.convert_ids_to_tokens(list(range(rows, min(len(tokenizer), rows + 3))))
    warnings.warn(
        ModelLoadWarning(
            f"the tokenizer has {len(tokenizer)} tokens and the model's embedding {rows} rows: the tokens from id "
            f"{rows} on ({', '.join(map(repr, extra))}{', ...' if len(tokenizer) > rows + 3 else ''}) have no row; "
            "a training run's prompts, special and template tokens are checked for them before it starts"
        ),
        stacklevel=2,
    )


INIT_SEED = 0  # what model loads draw new parameters from (:func:`seeded_init`)


def seeded_init(init_model: Callable) -> Callable:
    """``init_model`` (a worker role's) with torch's generators seeded with INIT_SEED while it runs, and as they were
    after: the parameters a load initialises (a critic's new value head, LoRA's adapters, weights missing from a
    checkpoint) are the same in every run, rank and process. torch seeds a new process's generator at random, so
    without it two runs of one config differed from their first critic value on."""

    @functools.wraps(init_model)
    def seeded(*args: Any, **kwargs: Any) -> Any:
        with torch.random.fork_rng():
            torch.manual_seed(INIT_SEED)
            return init_model(*args, **kwargs)

    return seeded


@contextlib.contextmanager
def load_warnings() -> Iterator[list[str]]:
    """Collect the ModelLoadWarnings raised in the block (their messages, in order, once each); other warnings pass
    through. A worker returns them to the controller, whose log shows them (a Ray worker's own output does not
    reach the console)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ModelLoadWarning)
        messages: list[str] = []
        yield messages
    for warning in caught:
        if issubclass(warning.category, ModelLoadWarning):
            if str(warning.message) not in messages:
                messages.append(str(warning.message))
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def padding_free_works(model: torch.nn.Module, setting: str) -> bool:
    """Whether the padding-free forward gives ``model``'s padded results
    (:func:`rl_core.models.logprob.padding_free_mismatch`
    within float32 or half-precision noise); when not, a ModelLoadWarning says that padded batches are used instead.
    A vision-language model runs padded (its image positions are computed from a padded batch's attention mask), said
    once."""
    from rl_core.models.multimodal import is_vision_language

    if is_vision_language(model):
        warnings.warn(
            ModelLoadWarning(
                f"{type(model).__name__} takes images: its batches run padded (the padding-free forward would need "
                f"each packed row's image positions), as {setting}=false does"
            ),
            stacklevel=2,
        )
        return False
    mismatch = padding_free_mismatch(model)
    tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 0.1
    if mismatch <= tolerance:
        return True
    warnings.warn(
        ModelLoadWarning(
            f"the padding-free forward of {type(model).__name__} disagrees with the padded one (max difference "
            f"{mismatch:.3g} on a dummy batch: packed rows attend to each other with this attention implementation); "
            f"using padded batches, as {setting}=false does"
        ),
        stacklevel=2,
    )
    return False
