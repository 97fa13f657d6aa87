"""Tunix's sampler on a Hugging Face Qwen3-MoE checkpoint, run in its own virtual environment.

google-tunix pulls in a large dependency set (grain, qwix, metrax, tensorflow_datasets, ...) and
pins safetensors<0.8, so it lives in ``.venv-tunix`` (gitignored), never in the test venv and never
in ``make test``. It gets the same jax / flax as ``.venv`` so both sides run the same XLA.

    python -m experiments.peer_tunix ensure            # create .venv-tunix once (stamped)
    .venv-tunix/bin/python -m experiments.peer_tunix worker --hf-dir D --batch B --prompt-len P \\
        --new N --repeats R --out result.json

Parent side (any venv; needs only numpy): :func:`ensure_venv` and
``tunix_decode(hf_dir, prompts [B, P], new, repeats, strict=True) -> {"tok_s", "tokens" [B, new], ...}``,
which runs the worker in a subprocess. The checkpoint is loaded by Tunix's own
``tunix.models.qwen3.params.create_model_from_safe_tensors`` (per-expert HF tensor names, as
transformers' save_pretrained and models.hf.save_pretrained write them); greedy, exactly ``new``
tokens (eos outside the vocab), no BOS added (see :class:`IdTokenizer`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-tunix"
# jax / flax pinned to .venv's versions so both peers run the same XLA; pip resolves the rest.
PACKAGES = ("google-tunix==0.1.7", "jax==0.10.2", "jaxlib==0.10.2", "flax==0.12.8")


def venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path = VENV, packages: tuple[str, ...] = PACKAGES) -> Path:
    """Create ``venv`` with python3 -m venv and pip install ``packages`` once; returns its python.

    A stamp file holding the package list marks a finished install: a changed list reinstalls, a
    failed pip leaves no stamp (the next call retries) and raises with pip's output.
    """
    want = "\n".join(packages) + "\n"
    if _stamp(venv).is_file() and _stamp(venv).read_text() == want:
        return venv_python(venv)
    if not venv_python(venv).exists():
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    t0 = time.perf_counter()
    pip = subprocess.run([str(venv_python(venv)), "-m", "pip", "install", "--quiet", *packages],
                         capture_output=True, text=True)
    if pip.returncode:
        raise RuntimeError(f"pip install {' '.join(packages)} into {venv} failed "
                           f"(rc={pip.returncode}):\n{pip.stdout[-4000:]}\n{pip.stderr[-4000:]}")
    _stamp(venv).write_text(want)
    print(f"installed {' '.join(packages)} into {venv} in {time.perf_counter() - t0:.0f}s", flush=True)
    return venv_python(venv)


def _stamp(venv: Path) -> Path:
    return venv / ".r3jax-installed"


class IdTokenizer:
    """Tokenizer over ids for Tunix's sampler: a prompt is its ids as a space-separated string.

    bos_id is None, so the sampler prepends nothing (it adds BOS only when bos_id() is truthy): both
    peers continue the very same ids. eos_id and pad_id lie outside the vocab: no token produced ends
    a row early or is masked as padding.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return None

    def eos_id(self) -> int:
        return self.vocab_size

    def pad_id(self) -> int:
        return -1


def _rope_theta(hf: dict) -> float:
    """rope theta of a config.json: 5.x ``rope_parameters``, else top level, else HF's default."""
    return float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10_000.0)))


def tunix_differences(hf: dict) -> dict:
    """``{field: (value, what Tunix's Qwen3 computes)}`` for the fields of a Qwen3-MoE config.json that
    Tunix's Qwen3 computes differently: it always renormalises top-k and applies RoPE with theta 1e6
    (its apply_rope is called without the config's theta)."""
    checks = [("norm_topk_prob", bool(hf.get("norm_topk_prob", False)), True),
              ("rope_theta", _rope_theta(hf), 1_000_000.0)]
    return {field: (value, want) for field, value, want in checks if value != want}


def tunix_config(hf: dict, strict: bool = True):
    """Tunix's qwen3 ModelConfig for a Qwen3-MoE config.json dict.

    ValueError naming the field for what Tunix's Qwen3 cannot load (dense layers: it makes every layer
    MoE when num_experts is set; attention bias) and, when strict, for what it computes differently
    (:func:`tunix_differences`; strict=False builds it anyway: same shapes, another function, so
    its throughput is comparable but its tokens are not).
    """
    from tunix.models.qwen3 import model as qwen3

    checks = [("mlp_only_layers", list(hf.get("mlp_only_layers") or []), []),
              ("decoder_sparse_step", int(hf.get("decoder_sparse_step", 1) or 1), 1),
              ("attention_bias", bool(hf.get("attention_bias", False)), False)]
    if strict:
        checks += [(field, value, want) for field, (value, want) in tunix_differences(hf).items()]
    for field, value, want in checks:
        if value != want:
            raise ValueError(f"config.json {field}={value!r}: expected {want!r} (what Tunix's Qwen3 computes)")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    return qwen3.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["moe_intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(_rope_theta(hf)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        use_tied_embedding=bool(hf.get("tie_word_embeddings", False)), num_experts=int(experts),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        shd_config=qwen3.ShardingConfig.get_default_sharding(is_sampling=True))


def worker(hf_dir: str, prompts, new: int, repeats: int, strict: bool = True) -> dict:
    """Greedy decode of ``new`` tokens from prompts [B, P] with tunix.generate.sampler.Sampler on the
    checkpoint (loaded by tunix.models.qwen3.params.create_model_from_safe_tensors). A warm-up call
    compiles; tok_s = B * new / the best wall time of ``repeats`` calls (prefill included). Tunix's
    decode loop runs one step past the last token it keeps (new + 1 forward passes to our new), and
    on CPU its MoE layer runs every expert on every token (its megablox path is TPU-only).
    ``differs``: :func:`tunix_differences` of the checkpoint (empty when strict)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import tunix
    from tunix.generate import sampler as sampler_lib
    from tunix.models.qwen3 import params as qwen3_params

    prompts = np.asarray(prompts, dtype=np.int32)
    batch, plen = prompts.shape
    hf = json.loads((Path(hf_dir) / "config.json").read_text())
    cfg = tunix_config(hf, strict)
    t0 = time.perf_counter()
    model = qwen3_params.create_model_from_safe_tensors(str(hf_dir), cfg, dtype=jnp.float32)
    load_s = time.perf_counter() - t0
    tok = IdTokenizer(cfg.vocab_size)
    cache = sampler_lib.CacheConfig(cache_size=plen + new, num_layers=cfg.num_layers,
                                    num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    sampler = sampler_lib.Sampler(model, tok, cache)
    texts = [tok.decode(p) for p in prompts]

    def call():
        t = time.perf_counter()
        out = sampler(texts, max_generation_steps=new, max_prompt_length=plen, temperature=0.0,
                      eos_tokens=[tok.eos_id()], echo=False)
        dt = time.perf_counter() - t
        if not np.array_equal(np.asarray(out.padded_prompt_tokens), prompts):
            raise RuntimeError("Tunix's sampler changed the prompts (BOS or padding): the continuations "
                               "would not be comparable")
        toks = np.stack([np.asarray(t) for t in out.tokens])
        if toks.shape != (batch, new):
            raise RuntimeError(f"Tunix returned tokens of shape {toks.shape}: expected {(batch, new)}")
        return dt, toks

    first_s, tokens = call()
    times = []
    for _ in range(repeats):
        dt, again = call()
        times.append(dt)
        if not np.array_equal(again, tokens):
            raise RuntimeError("Tunix's greedy tokens changed between calls")
    return {"tok_s": batch * new / min(times), "differs": tunix_differences(hf), "times_s": times,
            "first_call_s": first_s, "load_s": load_s, "batch": batch, "prompt_len": plen, "new_tokens": new,
            "tokens": tokens.tolist(),
            "tunix": getattr(tunix, "__version__", "unknown"), "jax": jax.__version__,
            "backend": jax.default_backend(), "devices": len(jax.devices())}


def tunix_decode(hf_dir, prompts, new: int, repeats: int = 3, strict: bool = True,
                 timeout_s: float = 1800) -> dict:
    """Run :func:`worker` in ``.venv-tunix`` (created on first use) on prompts [B, P]; returns the
    worker's dict with ``tokens`` as an int array [B, new] (and ``tok_s``, ``times_s``,
    ``first_call_s``, ``load_s``, ``differs``, versions). strict=False: also a checkpoint Tunix
    computes differently (see :func:`tunix_config`). The worker gets JAX_PLATFORMS=cpu and no XLA_FLAGS."""
    import tempfile

    import numpy as np

    py = ensure_venv()
    prompts = np.asarray(prompts)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    with tempfile.TemporaryDirectory() as d:
        np.save(Path(d) / "prompts.npy", prompts)
        out = Path(d) / "result.json"
        cmd = [str(py), "-m", "experiments.peer_tunix", "worker", "--hf-dir", str(hf_dir), "--batch",
               str(prompts.shape[0]), "--prompt-len", str(prompts.shape[1]), "--new", str(new), "--repeats",
               str(repeats), "--prompts", str(Path(d) / "prompts.npy"), "--out", str(out)]
        cmd += [] if strict else ["--lenient"]
        run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        if run.returncode:
            raise RuntimeError(f"Tunix worker failed (rc={run.returncode}):\n{run.stderr[-6000:]}")
        result = json.loads(out.read_text())
    result["tokens"] = np.array(result["tokens"], dtype=np.int64)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ensure", help="create .venv-tunix (once)")
    w = sub.add_parser("worker", help="run inside .venv-tunix: time Tunix's sampler, write JSON")
    w.add_argument("--hf-dir", required=True)
    w.add_argument("--batch", type=int, required=True)
    w.add_argument("--prompt-len", type=int, required=True)
    w.add_argument("--new", type=int, required=True)
    w.add_argument("--repeats", type=int, default=3)
    w.add_argument("--prompts", help=".npy of int prompts [batch, prompt-len]; default: random (--seed)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--out", required=True)
    w.add_argument("--lenient", action="store_true", help="also run a checkpoint Tunix computes differently "
                   "(rope theta, top-k renormalisation): throughput comparable, tokens not")
    args = ap.parse_args(argv)
    if args.cmd == "ensure":
        print(ensure_venv())
        return
    import numpy as np

    if args.prompts:
        prompts = np.load(args.prompts)
    else:
        vocab = json.loads((Path(args.hf_dir) / "config.json").read_text())["vocab_size"]
        prompts = np.random.default_rng(args.seed).integers(0, vocab, (args.batch, args.prompt_len))
    if prompts.shape != (args.batch, args.prompt_len):
        raise SystemExit(f"--prompts {args.prompts} has shape {prompts.shape}: expected "
                         f"{(args.batch, args.prompt_len)} (--batch, --prompt-len)")
    result = worker(args.hf_dir, prompts, args.new, args.repeats, strict=not args.lenient)
    Path(args.out).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "tokens"}), flush=True)


if __name__ == "__main__":
    main()
