"""Decode throughput of r3jax.engine vs Hugging Face transformers `generate` and Tunix's `Sampler` on
the same weights, route-capture overhead, and prefill work over a multi-turn conversation with /
without the prefix cache.

    python -m experiments.bench_decode [--quick] [--no-tunix]

All figures come from one run. Decode at B = 1, 8, 32, 64 on tiny, small_100m and the peer config
(experiments/peer_config.py: a Qwen3-MoE checkpoint made by transformers from random weights):
prompts of 16 random tokens (the peer config: 32), greedy, a fixed number of new tokens (128, the
peer config 64; 32 with --quick; no stop token); tokens/s = B * new tokens / wall seconds of one
generate call, prefill included, on every side. Tunix (google-tunix 0.1.7, its Qwen3 MoE model
loaded from the same safetensors files, in its own venv .venv-tunix that experiments/peer_tunix.py
creates on first use) runs on the peer config only: it computes every layer as MoE with rope theta
1e6 and renormalised top-k, which tiny (a dense first layer) and small_100m (theta 1e4) are not;
its figure is the best of its runs after a compiling call, in a subprocess between ours. Each figure is the best of its runs: ours with
capture on and off alternate, and HF's runs are spread between them, so load from other processes
hits all three alike. "capture on" returns every route row (s = 0); "capture off" asks for none,
so the engine runs its programs without the route-buffer writes; ``capture_on_over_off`` is the ratio
of their best runs, ``capture_on_over_off_paired`` the median over runs of on ÷ off run back to back
(a paired estimate, steadier on a loaded machine). HF: the model exported with
models.hf.save_pretrained, loaded by transformers.Qwen3MoeForCausalLM (fp32, torch CPU), plain
`generate` (no router outputs: its fastest path), with torch's faster thread count on this machine
(1 or all cores, picked per batch size by a short trial: hf_threads). hf_same_tokens: fraction of
rows whose greedy continuation equals ours token for token (both run the same model). The kernel
table (every expert kernel MoeConfig accepts, inside the engine, B = 8) uses 32 new tokens; against
the peers the engine runs its default kernel for this backend (``moe_impl=None``: "gather" on CPU), as
a user gets it. Each side is sized for the batch it runs: our engine has ``max_batch_size`` = B (HF's
cache and Tunix's sampler are built per batch too). On CPU our models are built with unrolled layers
(``scan_layers=False``; see experiments/bench_step.py for what the scanned layout costs there).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from experiments.common import table, write_json
from models import MoeConfig, MoeTransformer
from r3jax.engine import Engine, GenerateRequest

PROMPT = 16
# XLA:CPU copies each layer's weights out of a scanned stack every step (experiments/bench_step.py), so
# on CPU every model here is built with its layers unrolled (the same weights; only the layout differs)
SCAN = jax.default_backend() != "cpu"


def _prompts(cfg, batch, seed=0, length=PROMPT):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, length))


def _engine(model, new, batch, impl, prompt=PROMPT):
    """An engine configured for ``batch`` requests of ``prompt + new`` tokens, as HF's cache and Tunix's
    sampler are sized for the batch they run (an engine of 64 requests running 8 pads every decode call
    to its smallest decode bucket, 16, and every prefill step to 64 decode rows: bench_paged and
    bench_engine measure a server's engine under a mix)."""
    return Engine(model, max_seq_len=prompt + new, max_batch_size=batch, prefix_cache_bytes=0, moe_impl=impl)


def _ours(engine, prompts, new, capture):
    reqs = [GenerateRequest(prompt_ids=p.tolist(), max_tokens=new, temperature=0.0,
                            return_routed_experts=capture) for p in prompts]
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    dt = time.perf_counter() - t0
    assert all(len(o.output_ids) == new for o in outs)
    if capture:
        assert all(o.routed_experts.shape[0] == prompts.shape[1] + new - 1 for o in outs)
    return dt, np.array([o.output_ids for o in outs])


def _hf(model, prompts, new, threads):
    import torch

    torch.set_num_threads(threads)
    ids = torch.tensor(prompts)
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
        dt = time.perf_counter() - t0
    return dt, out[:, prompts.shape[1]:].numpy()


def _hf_threads(model, prompts) -> int:
    """torch's faster thread count here (its OpenMP threads spin; on a busy machine 1 can beat 2)."""
    best = {}
    for threads in (1, os.cpu_count() or 1):
        _hf(model, prompts, 2, threads)
        best[threads] = min(_hf(model, prompts, 8, threads)[0] for _ in range(2))
    return min(best, key=best.get)


def _load_hf(model, hf_dir=None):
    import torch
    import transformers

    from models.hf import save_pretrained

    if hf_dir is not None:
        return transformers.Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d)
        return transformers.Qwen3MoeForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def _kernels(cfg) -> list[str]:
    """The expert kernels this checkout's MoeConfig accepts."""
    ok = []
    for impl in ("dense", "ragged", "loop", "gather"):
        try:
            cfg.replace(moe_impl=impl)
            ok.append(impl)
        except ValueError:
            pass
    return ok


def bench_impls(name, model, batches, new, repeats):
    """Decode tokens/s of the engine with each expert kernel (capture on)."""
    rows = []
    for impl in _kernels(model.config):
        for b in batches:
            eng = _engine(model, new, b, impl)
            prompts = _prompts(model.config, b)
            _ours(eng, prompts, new, True)  # compiles the prefill step and the decode loop
            dt = min(_ours(eng, prompts, new, True)[0] for _ in range(repeats))
            rows.append({"config": name, "moe_impl": impl, "B": b, "new_tokens": new, "tok_s": b * new / dt})
            print(rows[-1], flush=True)
            eng.close()
    return rows


def bench_vs_peers(name, model, impl, batches, new, repeats, hf_repeats, hf_model, *, prompt=PROMPT,
                   tunix_dir=None):
    """Ours with capture on and off (alternating, ``repeats`` each), HF (``hf_repeats``, spread between
    ours) and, given ``tunix_dir`` (the checkpoint's directory), Tunix (one subprocess of its own
    repeats, halfway through ours) on the same prompts; every figure is the best of its runs."""
    rows = []
    for b in batches:
        eng = _engine(model, new, b, impl, prompt)
        prompts = _prompts(model.config, b, length=prompt)
        # a fresh engine per batch: one untimed run each way compiles its prefill step and decode loop
        _ours(eng, prompts, new, True), _ours(eng, prompts, new, False)
        threads = _hf_threads(hf_model, prompts)
        times, seqs = {"on": [], "off": [], "hf": []}, {}
        runs = {"on": lambda: _ours(eng, prompts, new, True), "off": lambda: _ours(eng, prompts, new, False),
                "hf": lambda: _hf(hf_model, prompts, new, threads)}
        hf_at = set(np.linspace(0, repeats - 1, hf_repeats).round().astype(int).tolist())
        tunix = None
        for r in range(repeats):
            for key in (("on", "off") if r % 2 == 0 else ("off", "on")) + (("hf",) if r in hf_at else ()):
                dt, seqs[key] = runs[key]()
                times[key].append(dt)
            if tunix_dir is not None and r == repeats // 2:
                from experiments.peer_tunix import tunix_decode

                tunix = tunix_decode(tunix_dir, prompts, new, repeats=max(2, repeats // 2))
        on, off, hf = (b * new / min(times[k]) for k in ("on", "off", "hf"))
        ours, theirs = seqs["on"], seqs["hf"]
        row = {"config": name, "moe_impl": eng.config.moe_impl, "B": b, "prompt_tokens": prompt, "new_tokens": new,
               "repeats": repeats, "hf_repeats": len(times["hf"]), "hf_threads": threads,
               "ours_capture_on_tok_s": on, "ours_capture_off_tok_s": off, "capture_on_over_off": on / off,
               # run r's on and off ran back to back: the median of their ratios shrugs off a lucky best run
               "capture_on_over_off_paired": float(np.median(np.asarray(times["off"]) / np.asarray(times["on"]))),
               "hf_tok_s": hf, "ours_over_hf": on / hf, "hf_same_tokens": float(np.mean((ours == theirs).all(-1)))}
        if tunix is not None:
            row.update(tunix_tok_s=tunix["tok_s"], ours_over_tunix=on / tunix["tok_s"],
                       tunix_repeats=len(tunix["times_s"]), tunix_compile_s=tunix["first_call_s"],
                       tunix_same_tokens=float(np.mean((ours == tunix["tokens"]).all(-1))))
        rows.append(row)
        print(rows[-1], flush=True)
        eng.close()
    return rows


def bench_multiturn(turns, first=32, user=16, gen=16):
    """Prefill tokens computed per turn over a growing conversation, prefix cache on vs off (tiny)."""
    model = MoeTransformer(MoeConfig.tiny(), rngs=nnx.Rngs(0))
    max_len = first + turns * (user + gen)
    engines = {c: Engine(model, max_seq_len=max_len, max_batch_size=1, prefix_cache_bytes=(64 << 20) * c,
                         prefill_chunk=512) for c in (True, False)}
    rng = np.random.default_rng(0)
    new_tokens = [rng.integers(0, 272, first if t == 0 else user).tolist() for t in range(turns)]
    rows, history, same = [], {True: [], False: []}, True
    for t in range(turns):
        row = {"turn": t + 1}
        outs = {}
        for c, eng in engines.items():
            history[c] = history[c] + new_tokens[t]
            [out] = eng.generate([GenerateRequest(prompt_ids=list(history[c]), max_tokens=gen, temperature=0.0,
                                                  return_routed_experts=True)])
            history[c] += out.output_ids
            outs[c] = out
            key = "with_cache" if c else "without_cache"
            row[f"prefill_tokens_{key}"] = eng.stats["prefill_tokens"]
        row["prompt_tokens"] = outs[True].prompt_tokens
        row["cached_tokens"] = outs[True].cached_tokens
        same &= outs[True].output_ids == outs[False].output_ids
        rows.append(row)
    return rows, same


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32 new tokens, fewer repeats")
    ap.add_argument("--no-tunix", action="store_true", help="skip Tunix (no .venv-tunix is created)")
    args = ap.parse_args()
    new = 32 if args.quick else 128
    batches = (1, 8, 32, 64)
    impl_rows, rows = [], []
    for name in ("tiny", "small_100m", "peer"):
        if name == "peer":
            from experiments.peer_config import peer_model

            model, hf_dir = peer_model(seed=0, scan_layers=SCAN)
        else:
            model, hf_dir = MoeTransformer(MoeConfig.preset(name, scan_layers=SCAN), rngs=nnx.Rngs(0)), None
        small = name == "tiny"
        repeats, hf_repeats = ((6, 2) if small else (2, 1)) if args.quick else ((12, 4) if small else (6, 2))
        impl_rows += bench_impls(name, model, (8,), 32, 3 if small else 2)
        peer = name == "peer"
        rows += bench_vs_peers(name, model, None, batches, 32 if args.quick else (64 if peer else new), repeats,
                               hf_repeats, _load_hf(model, hf_dir), prompt=32 if peer else PROMPT,
                               tunix_dir=hf_dir if peer and not args.no_tunix else None)
    turn_rows, same = bench_multiturn(8 if args.quick else 16)

    print("\n## Expert kernel inside the engine (decode tok/s, capture on)")
    print(table(impl_rows, ["config", "moe_impl", "B", "new_tokens", "tok_s"]))
    print("\n## Decode vs Hugging Face transformers generate and Tunix's Sampler (same weights, greedy)")
    print(table(rows, ["config", "moe_impl", "B", "prompt_tokens", "new_tokens", "ours_capture_on_tok_s",
                       "ours_capture_off_tok_s", "capture_on_over_off", "capture_on_over_off_paired", "hf_tok_s",
                       "hf_threads", "ours_over_hf",
                       "hf_same_tokens", "tunix_tok_s", "ours_over_tunix", "tunix_same_tokens"]))
    print("\n## Multi-turn prefill work (tiny; 32-token first prompt, +16 user and +16 generated per turn)")
    print(table(turn_rows, ["turn", "prompt_tokens", "cached_tokens", "prefill_tokens_with_cache",
                            "prefill_tokens_without_cache"]))
    print(f"same tokens with and without the prefix cache in every turn: {same}")
    path = write_json("bench_decode", {"quick": args.quick, "prompt_tokens": PROMPT, "new_tokens": new,
                                       "kernels": impl_rows, "decode": rows,
                                       "multiturn": turn_rows, "multiturn_same_tokens": same,
                                       "jax_backend": jax.default_backend()})
    print("wrote", path)


if __name__ == "__main__":
    main()
