"""Byte tokenizer and the Hugging Face tokenizers + chat template adapter, rendered in pieces."""

import json

import pytest

from models import MoeConfig
from r3jax.rollout import ByteTokenizer, HFChatTokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Drops every assistant message but the last one: a template that rewrites history.
REWRITING = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>"
             "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_byte_tokenizer_round_trip_and_format():
    tok = ByteTokenizer()
    assert tok.vocab_size == MoeConfig.tiny().vocab_size == 272
    ids = tok.encode("3+4=é")
    assert ids == [51, 43, 52, 61, 0xC3, 0xA9] and tok.decode(ids) == "3+4=é"
    prompt = tok.initial_prompt("3+4=", system="add")
    assert prompt == [256, 261, 97, 100, 100, 259, 51, 43, 52, 61, 260]
    assert tok.observation("h") == [259, 104, 260]
    assert tok.decode(prompt, skip_special_tokens=False) == "<bos><system>add<user>3+4=<assistant>"
    assert tok.decode(prompt) == "add3+4=" and tok.stop_token_ids == (257,)
    with pytest.raises(ValueError, match=r"token id 300: expected an id in \[0, vocab_size=272\)"):
        tok.decode([300])


def _hf_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


def test_hf_chat_pieces_reassemble_the_template(tmp_path):
    raw = _hf_tokenizer()
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": {"content": "<|im_end|>"}}))
    tok = HFChatTokenizer.from_file(tmp_path / "tokenizer.json")
    assert tok.stop_token_ids == (raw.token_to_id("<|im_end|>"),) and tok.vocab_size == 258
    # turn by turn, as the agent loop builds it: prompt, reply + stop, observation, reply + stop
    seq = tok.initial_prompt("3+4=") + tok.encode("7") + [tok.eos_id]
    seq += tok.observation("7+2=") + tok.encode("9") + [tok.eos_id]
    msgs = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"},
            {"role": "user", "content": "7+2="}, {"role": "assistant", "content": "9"}]
    assert tok.decode(seq, skip_special_tokens=False) + "\n" == tok.render(msgs, False)
    assert tok.decode(tok.initial_prompt("hi", system="be brief"), skip_special_tokens=False) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok.observation("x"), skip_special_tokens=True) == "\nuser\nx\nassistant\n"


def test_hf_chat_template_that_rewrites_history_is_refused():
    with pytest.raises(ValueError, match="rewrites history, so per-turn routes cannot stay aligned"):
        HFChatTokenizer(_hf_tokenizer(), REWRITING, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match=r"eos_token='<\|eot\|>': not in the tokenizer's vocabulary"):
        HFChatTokenizer(_hf_tokenizer(), CHATML, eos_token="<|eot|>")


def test_hf_from_file_needs_a_template(tmp_path):
    _hf_tokenizer().save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="chat_template: none given"):
        HFChatTokenizer.from_file(tmp_path / "tokenizer.json", eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="no such file"):
        HFChatTokenizer.from_file(tmp_path / "missing.json")
