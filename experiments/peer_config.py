"""The peer config: a Qwen3-MoE checkpoint written by transformers from random weights, loaded by ours.

vocab 4096, hidden 256, 4 layers (all MoE), 8 query / 2 kv heads of dim 32, 16 experts top-4 of
dim 128, renormalised top-k, fp32, untied embeddings, rope theta 1e6 (Qwen3's; Tunix's Qwen3
applies RoPE with theta 1e6 whatever its config says, so the peers compute the same function).

    model, hf_dir = peer_model(seed=0)
    check_greedy(model, hf_dir)   # HF generate and r3jax.engine agree token for token
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from models import MoeTransformer
from r3jax.engine import Engine, GenerateRequest

PEER = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, intermediate_size=512,
            norm_topk_prob=True, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
            rms_norm_eps=1e-6, max_position_embeddings=4096)
ROPE_THETA = 1_000_000.0


def hf_config():
    """transformers.Qwen3MoeConfig of the peer config (rope theta under both spellings: 4.x reads
    ``rope_theta``, 5.x ``rope_parameters``)."""
    import transformers

    return transformers.Qwen3MoeConfig(**PEER, rope_theta=ROPE_THETA,
                                       rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA})


def write_peer_checkpoint(out_dir, seed: int = 0) -> Path:
    """Qwen3MoeForCausalLM(hf_config()) initialised under torch.manual_seed(seed), saved (safetensors,
    fp32) to out_dir; returns out_dir."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(hf_config()).to(torch.float32).eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def peer_model(seed: int = 0, hf_dir=None, scan_layers: bool = True) -> tuple[MoeTransformer, Path]:
    """(our MoeTransformer, hf_dir) of the peer config. hf_dir defaults to a fresh temporary directory
    (left in place for the caller: HF and Tunix load the same files)."""
    from models.hf import load_pretrained

    hf_dir = Path(tempfile.mkdtemp(prefix=f"peer-qwen3moe-s{seed}-") if hf_dir is None else hf_dir)
    write_peer_checkpoint(hf_dir, seed)
    cfg, model = load_pretrained(hf_dir, scan_layers=scan_layers)
    want = {"vocab_size": 4096, "hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2,
            "head_dim": 32, "num_experts": 16, "top_k": 4, "moe_intermediate_size": 128, "norm_topk_prob": True,
            "first_dense_layers": 0, "tie_embeddings": False, "rope_theta": ROPE_THETA}
    got = {k: getattr(cfg, k) for k in want}
    if got != want:
        raise RuntimeError(f"{hf_dir}: the peer config loaded as {got}: expected {want}")
    return model, hf_dir


def ours_greedy(model: MoeTransformer, prompts: np.ndarray, new: int, engine: Engine | None = None) -> np.ndarray:
    """Greedy continuations [B, new] of prompts [B, P] by r3jax.engine (no stop token)."""
    prompts = np.asarray(prompts)
    if engine is None:
        engine = Engine(model, max_seq_len=prompts.shape[1] + new, max_batch_size=len(prompts),
                        prefix_cache_bytes=0)
    outs = engine.generate([GenerateRequest(prompt_ids=p.tolist(), max_tokens=new, temperature=0.0,
                                            return_routed_experts=False) for p in prompts])
    return np.array([o.output_ids for o in outs])


def hf_greedy(hf_dir, prompts: np.ndarray, new: int) -> np.ndarray:
    """Greedy continuations [B, new] by transformers' generate on the checkpoint (fp32, torch CPU)."""
    import torch
    import transformers

    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor(np.asarray(prompts))
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].numpy()


def peer_prompts(batch: int, length: int, seed: int = 0) -> np.ndarray:
    """Random prompts [batch, length] over the peer vocab."""
    return np.random.default_rng(seed).integers(0, PEER["vocab_size"], (batch, length))


def check_greedy(model: MoeTransformer, hf_dir, batch: int = 2, prompt_len: int = 16, new: int = 16,
                 seed: int = 0) -> dict:
    """Greedy tokens of HF generate vs our engine on ``batch`` random prompts: ``{"rows_equal":
    fraction of rows equal token for token, "tokens_equal": fraction of positions equal, "ours",
    "hf"}``."""
    prompts = peer_prompts(batch, prompt_len, seed)
    ours, hf = ours_greedy(model, prompts, new), hf_greedy(hf_dir, prompts, new)
    return {"rows_equal": float((ours == hf).all(-1).mean()), "tokens_equal": float((ours == hf).mean()),
            "ours": ours, "hf": hf}


if __name__ == "__main__":
    m, d = peer_model()
    r = check_greedy(m, d)
    print(d, {k: r[k] for k in ("rows_equal", "tokens_equal")})
