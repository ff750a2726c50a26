"""A small built-in Llama checkpoint, generated locally so that nothing has to be downloaded.

`write_builtin_model(out_dir)` writes a deterministic, randomly initialised Llama model in
Hugging Face format (config.json, model.safetensors, generation_config.json and tokenizer files)
that `AutoModelForCausalLM.from_pretrained(out_dir)` and `AutoTokenizer.from_pretrained(out_dir)`
load offline. `resolve_model_path("builtin:tiny-llama")` writes it once into a cache directory and
returns that directory; any other model string must be a local checkpoint directory.

The "tiny-llama" model: vocab 8192, hidden 384, 6 layers, 8 attention heads with 4 KV heads (GQA,
head_dim 48), MLP 1024, untied embeddings, float32 -- 16,028,544 parameters (about 64 MB on disk).
Its tokenizer is a byte-level BPE (so any UTF-8 text, emoji included, round-trips exactly) trained
with the `tokenizers` library on a synthetic English corpus generated in this module. Special
tokens follow the Llama convention: <unk>=0, <s>=1 (bos), </s>=2 (eos), <pad>=3.

"tiny-moe" (Qwen3-MoE: 8 experts, each token routed to 2; 37,281,216 parameters, 16,047,552 read
per token) and "moe-400m" (a realistic MoE shape: 406,176,896 parameters, 75,875,456 per token) share
the tokenizer, and so does "tiny-mla" (DeepSeek-V3's latent attention and routing: 23,541,504
parameters, 14,694,144 per token; its KV is one 128+32 latent per token and layer) and "mla-400m" (its
realistic shape: 403,098,432 parameters, 100,322,112 per token); "llama-200m" is a realistic dense shape.

The weights are random: the model writes gibberish, but it is real, exercises the real code
paths (GQA, RoPE, RMSNorm, SwiGLU), and greedy decoding of it is reproducible.

"stdlib-4m" is not written but shipped: a trained checkpoint in engine/builtin_checkpoints/, packed
to int8 rows (engine/packed_checkpoint.py) and expanded into the cache on first use, the
yardstick model (a 3.8M-parameter Llama trained on Python's standard library by
benchmarks/yardstick_train.py; docs/yardstick.md) whose text can be read, so numerical errors show.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

BUILTIN_PREFIX = "builtin:"

# Special tokens in id order (Llama convention: unk, bos, eos; pad appended).
_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
UNK_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = 0, 1, 2, 3

BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        # Bump when the written files would change, so old cache entries are not reused.
        "version": 1,
        "seed": 0,
        # lm_head.weight is multiplied by this after init; see _build_model.
        "lm_head_scale": 10.0,
        "config": {
            "vocab_size": 8192,
            "hidden_size": 384,
            "num_hidden_layers": 6,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "intermediate_size": 1024,
            "max_position_embeddings": 4096,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "tie_word_embeddings": False,
            "bos_token_id": BOS_TOKEN_ID,
            "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": PAD_TOKEN_ID,
        },
        "corpus_seed": 0,
        "corpus_sentences": 20000,
    },
}
# A realistic shape (the layer sizes of a ~200M Llama) for performance work: the engine's costs
# split between GEMMs, attention and memory traffic as they do on real checkpoints. Same tokenizer,
# same initialisation; written as a bfloat16 checkpoint.
BUILTIN_MODELS["llama-200m"] = {
    **BUILTIN_MODELS["tiny-llama"],
    "dtype": "bfloat16",
    "config": {**BUILTIN_MODELS["tiny-llama"]["config"], "hidden_size": 1024, "num_hidden_layers": 16,
               "num_attention_heads": 16, "num_key_value_heads": 8, "intermediate_size": 2816},
}

# A mixture-of-experts model (Qwen3-MoE: q/k norms, 8 experts of which each token is routed to 2,
# renormalised), with tiny-llama's tokenizer, attention shape and initialisation.
_TINY = BUILTIN_MODELS["tiny-llama"]["config"]
_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "head_dim": 48}
BUILTIN_MODELS["tiny-moe"] = {**BUILTIN_MODELS["tiny-llama"], "family": "Qwen3Moe", "router_scale": 4.0,
                              "config": {**_TINY, **_MOE}}
# A realistic MoE shape for performance work: Qwen3-30B-A3B's proportions (8 query heads per KV
# head, queries wider than the hidden size, top-8 routing over narrow experts) scaled down to 64
# experts of width 0.4 x hidden.
BUILTIN_MODELS["moe-400m"] = {
    **BUILTIN_MODELS["tiny-moe"], "dtype": "bfloat16",
    "config": {**_TINY, **_MOE, "hidden_size": 640, "num_hidden_layers": 12, "num_attention_heads": 16,
               "num_key_value_heads": 2, "head_dim": 64, "num_experts": 64, "num_experts_per_tok": 8,
               "moe_intermediate_size": 256},
}
# moe-400m's dense twin: the same attention, and one dense MLP as wide as the 8 experts a token is
# routed to (8 x 256): its parameters are moe-400m's active ones but the routers' (75,382,400 of
# 75,875,456). What a MoE decode step is measured against (benchmarks/moe_step.py).
BUILTIN_MODELS["moe-400m-dense"] = {
    **BUILTIN_MODELS["tiny-llama"], "family": "Qwen3", "dtype": "bfloat16",
    "config": {**_TINY, "hidden_size": 640, "num_hidden_layers": 12, "num_attention_heads": 16,
               "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 2048},
}

# Multi-head latent attention with experts (DeepSeek-V3: a q LoRA, one 128+32 latent per token and
# layer, a dense first layer, 8 routed experts in 4 groups, top-2, one shared expert).
# `topk_method`/`scoring_func` as DeepSeek-V3's published config.json names its router (transformers
# does not read them; vLLM does).
_DEEPSEEK_V3 = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.5,
                "norm_topk_prob": True, "first_k_dense_replace": 1}
BUILTIN_MODELS["tiny-mla"] = {
    **BUILTIN_MODELS["tiny-llama"], "family": "DeepseekV3", "router_scale": 4.0, "version": 2,
    "config": {**_TINY, **_DEEPSEEK_V3, "num_key_value_heads": 8, "q_lora_rank": 192, "kv_lora_rank": 128,
               "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 48, "n_routed_experts": 8,
               "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
               "moe_intermediate_size": 256},
}
# A realistic MLA shape for performance work: DeepSeek-V3's layout and its very latent (512 + RoPE 64,
# the only size vLLM's CPU MLA kernel takes), a q LoRA, 8 expert groups of which a token's top-8
# come from the best 4, one shared expert, a dense first layer; moe-400m's width and experts.
BUILTIN_MODELS["mla-400m"] = {
    **BUILTIN_MODELS["tiny-mla"], "dtype": "bfloat16", "version": 1,
    "config": {**_TINY, **_DEEPSEEK_V3, "hidden_size": 640, "num_hidden_layers": 12, "num_attention_heads": 16,
               "num_key_value_heads": 16, "intermediate_size": 1792, "q_lora_rank": 384, "kv_lora_rank": 512,
               "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 64,
               "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "n_shared_experts": 1,
               "moe_intermediate_size": 256},
}

# Trained checkpoints shipped with the package, packed, in SHIPPED_DIR/<name>; expanded into the cache.
SHIPPED_MODELS = ("stdlib-4m",)
SHIPPED_DIR = Path(__file__).resolve().parent / "builtin_checkpoints"

# Each message as "<|role|>\ncontent\n", then "<|assistant|>\n" when a generation prompt is asked
# for. No bos in the template: `tokenizer(text)` prepends it (as Llama's tokenizer does).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# ---------------------------------------------------------------------------------------------
# Synthetic training corpus for the tokenizer
# ---------------------------------------------------------------------------------------------

_WORDS = """
the of and to a in is it you that he was for on are with as his they be at one have this from
or had by not word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name
very through just form sentence great think say help low line differ turn cause much mean before
move right boy old too same tell does set three want air well also play small end put home read
hand port large spell add even land here must big high such follow act why ask men change went
light kind off need house picture try us again animal point mother world near build self earth
father head stand own page should country found answer school grow study still learn plant cover
food sun four between state keep eye never last let thought city tree cross farm hard start might
story saw far sea draw left late run while press close night real life few north open seem
together next white children begin got walk example ease paper group always music those both mark
often letter until mile river car feet care second book carry took science eat room friend began
idea fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl
usual young ready above ever red list though feel talk bird soon body dog family direct pose leave
song measure door product black short numeral class wind question happen complete ship area half
rock order fire south problem piece told knew pass since top whole king space heard best hour
better true during hundred five remember step early hold west ground interest reach fast verb sing
listen six table travel less morning ten simple several vowel toward war lay against pattern slow
center love person money serve appear road map rain rule govern pull cold notice voice unit power
town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
correct able pound done beauty drive stood contain front teach week final gave green quick develop
ocean warm free minute strong special mind behind clear tail produce fact street inch multiply
nothing course stay wheel full force blue object decide surface deep moon island foot system busy
test record boat common gold possible plane stead dry wonder laugh thousand ago ran check game
shape equate hot miss brought heat snow tire bring yes distant fill east paint language among
server request token model cache memory batch queue worker network latency compute prefill decode
""".split()

_SUFFIXES = ["", "", "", "", "s", "s", "ed", "ing", "er", "ly", "ness", "ful", "less", "able", "ment", "est"]
_PREFIXES = ["", "", "", "", "", "", "un", "re", "pre", "dis", "over", "under", "mis", "non"]
_ONSETS = ["b", "br", "c", "ch", "cl", "d", "dr", "f", "fl", "g", "gr", "h", "j", "k", "l", "m", "n",
           "p", "pl", "qu", "r", "s", "sh", "sk", "st", "t", "th", "tr", "v", "w", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y"]
_CODAS = ["", "", "", "n", "r", "l", "s", "t", "nd", "rt", "ck", "ng", "x"]
_PUNCT_END = [".", ".", ".", ".", "!", "?", "...", ";"]
_EXTRA = ["é", "ü", "ñ", "ç", "ß", "ø", "—", "€", "°", "→", "日本", "中文", "😀", "👍", "🚀"]


def _synthetic_corpus(seed: int, n_sentences: int) -> Iterator[str]:
    """Deterministic pseudo-English text: common words (Zipf-weighted) with English-like prefixes
    and suffixes, invented names, numbers, punctuation and a sprinkle of non-ASCII."""
    rng = random.Random(seed)
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) ** 0.8 for rank in range(len(_WORDS))))

    def name() -> str:
        syl = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                      for _ in range(rng.randint(2, 3)))
        return syl.capitalize()

    names = [name() for _ in range(4000)]
    for _ in range(n_sentences):
        words = []
        for i in range(rng.randint(4, 18)):
            r = rng.random()
            if r < 0.05:
                w = rng.choice(names)
            elif r < 0.09:
                w = str(rng.randint(0, 10 ** rng.randint(1, 6)))
            elif r < 0.095:
                w = rng.choice(_EXTRA)
            else:
                w = rng.choice(_PREFIXES) + rng.choices(_WORDS, cum_weights=cum_weights)[0] + rng.choice(_SUFFIXES)
            if i > 0 and rng.random() < 0.07:
                w += rng.choice([",", ",", ":", ")", "'s"])
            words.append(w)
        words[0] = words[0][:1].upper() + words[0][1:]
        sentence = " ".join(words) + rng.choice(_PUNCT_END)
        if rng.random() < 0.05:
            sentence = '"' + sentence + '"'
        yield sentence


# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------


def _build_tokenizer(spec: dict[str, Any], texts: Iterable[str] | None = None):
    """The byte-level BPE tokenizer of `spec`'s vocab size, trained on `texts` (default: the
    synthetic corpus of `spec`; benchmarks/yardstick_train.py passes source files)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = spec["config"]["vocab_size"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # No normalizer and no prefix space: decode(encode(text)) == text for any UTF-8 string.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,  # ids 0..3 in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is <unk>
        show_progress=False,
    )
    if texts is None:
        texts = _synthetic_corpus(spec["corpus_seed"], spec["corpus_sentences"])
    tok.train_from_iterator(texts, trainer)
    for tid, token in enumerate(_SPECIAL_TOKENS):
        if tok.token_to_id(token) != tid:
            raise RuntimeError(f"special token {token!r} got id {tok.token_to_id(token)}, expected {tid}")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A",
        pair="<s> $A <s> $B",
        special_tokens=[("<s>", BOS_TOKEN_ID)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=spec["config"]["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def _build_model(spec: dict[str, Any]):
    import torch
    import transformers
    from transformers import GenerationConfig

    dtype = spec.get("dtype", "float32")
    family = spec.get("family", "Llama")
    config = getattr(transformers, f"{family}Config")(**spec["config"], dtype=dtype)
    torch.manual_seed(spec["seed"])
    model = getattr(transformers, f"{family}ForCausalLM")(config).to(torch.float32).eval()
    with torch.no_grad():
        # Greedy outputs must be reproducible across different but equivalent compute orders
        # (batched vs single, paged vs contiguous attention, prefill vs cached decode, different
        # kernels), so the argmax must not sit on a near-tie. With the std-0.02 init the logits
        # have std ~0.4, the softmax is almost flat (median top-1 probability ~6e-4) and the
        # median top-2 gap is ~0.05-0.2; scaled by 10 they have std ~4, a median top-1
        # probability of ~0.15-0.55 and a median top-2 gap of ~0.5-1.7 (text vs random tokens),
        # so greedy, sampling and logprob tests see a decisive distribution and can use
        # absolute thresholds. Note the compute-order noise in the logits scales with lm_head
        # too (measured: float32 prefill vs cached decode ~1.4e-5 at std 4, ~1.5e-6 at std 0.4),
        # so the gap-to-noise ratio (~1e3 at the smallest gap over 300 positions in float32) is
        # what keeps greedy stable; bfloat16 noise (~0.2 at std 4) can flip near-ties.
        model.lm_head.weight.mul_(spec["lm_head_scale"])
        # Likewise a router's top-k must not sit on a near-tie between two experts.
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(spec["router_scale"])
    model = model.to(getattr(torch, dtype))  # initialised in float32 on every dtype: same draws
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        do_sample=False,
    )
    return model


def write_builtin_model(out_dir: str | Path, name: str = "tiny-llama") -> Path:
    """Write the built-in model `name` as a Hugging Face checkpoint into `out_dir` (created if
    needed) and return its path. Deterministic: the same files byte for byte on every call (for a
    given torch/transformers/tokenizers version). tiny-llama: 16,028,544 parameters."""
    from transformers.utils import logging as hf_logging

    spec = _spec(name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(spec)
    model = _build_model(spec)
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar for a 64 MB file
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    return out


# ---------------------------------------------------------------------------------------------
# Resolution of a model argument to a checkpoint directory
# ---------------------------------------------------------------------------------------------


def _spec(name: str) -> dict[str, Any]:
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown builtin model {name!r}; known builtin models: {_known()}") from None


def _known() -> str:
    return ", ".join(BUILTIN_PREFIX + n for n in sorted([*BUILTIN_MODELS, *SHIPPED_MODELS]))


def cache_root() -> Path:
    """$PDCLUSTER_CACHE, default ~/.cache/pdcluster."""
    root = os.environ.get("PDCLUSTER_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "pdcluster"


def _is_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` where fcntl exists; the rename below is what keeps
    the cache correct, the lock only saves concurrent processes from writing the model twice."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ensure_builtin(name: str) -> Path:
    spec = _spec(name)
    return _cached(f"{name}-v{spec['version']}", lambda tmp: write_builtin_model(tmp, name))


def _cached(entry: str, write: Callable[[Path], object]) -> Path:
    """$PDCLUSTER_CACHE/builtin/<entry>, written by `write(tmp)` once (under a lock, by rename)."""
    parent = cache_root() / "builtin"
    target = parent / entry
    if _is_complete(target):
        return target
    parent.mkdir(parents=True, exist_ok=True)
    with file_lock(parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process wrote it while we waited
            return target
        if target.exists():  # not written by us (entries appear only by rename): move it aside
            stale = Path(tempfile.mkdtemp(dir=parent, prefix=f".{target.name}.stale-"))
            os.rename(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{target.name}.tmp-"))
        try:
            write(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp made it 0700
            try:
                os.rename(tmp, target)
            except OSError:
                if not _is_complete(target):
                    raise
                # Lost a race with a process that did not take the lock: use its copy.
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _shipped(name: str) -> Path:
    """A shipped checkpoint, packed in the package (engine/packed_checkpoint.py), expanded into the
    cache on first use; the cache entry is named by the packed weights' digest."""
    from engine.packed_checkpoint import PACKED_WEIGHTS, expand

    src = SHIPPED_DIR / name
    weights = src / PACKED_WEIGHTS
    if not (weights.is_file() and (src / "config.json").is_file()):
        raise FileNotFoundError(f"the shipped checkpoint of {BUILTIN_PREFIX}{name} is missing from {src}")
    st = weights.stat()
    return _cached(f"{name}-{_digest(weights, st.st_size, st.st_mtime_ns)}", lambda tmp: expand(src, tmp))


@functools.lru_cache(maxsize=8)
def _digest(path: Path, size: int, mtime_ns: int) -> str:
    """The first 12 hex digits of a file's SHA-256, read once per version of the file (every engine,
    router and LLM of a process resolves the default model: 4 MB hashed each time was 10 ms)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def resolve_model_path(model: str) -> Path:
    """The checkpoint directory for `model`: "builtin:<name>" is written on first use into
    $PDCLUSTER_CACHE/builtin/<name>-v<version> (default cache ~/.cache/pdcluster), except a shipped
    one (SHIPPED_MODELS: its directory in the package); anything else must be a local directory
    holding a Hugging Face checkpoint (config.json)."""
    if model.startswith(BUILTIN_PREFIX):
        name = model[len(BUILTIN_PREFIX):]
        return _shipped(name) if name in SHIPPED_MODELS else _ensure_builtin(name)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(
        f"model path {model!r} not found / not a Hugging Face checkpoint directory "
        f"(config.json missing); give a local checkpoint directory or a builtin model ({_known()})"
    )
