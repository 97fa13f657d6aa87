"""Chat tokenizers that turn dialogue text into token chunks the agent loop can append.

The agent loop never re-renders a conversation: it appends token chunks (the first prompt, the
generated tokens, each observation), so the tokens sent every turn begin with exactly the tokens
whose routes are already recorded. A tokenizer therefore renders *pieces* of a chat:

- ``initial_prompt(text, system=None)``: BOS, optional system turn, the first user turn and the
  assistant generation prompt;
- ``observation(text)``: whatever the template puts after the assistant's stop token, the next user
  turn and the assistant generation prompt.

The model ends its turn with one of ``stop_token_ids``. :class:`ByteTokenizer` is built in (bytes
0..255 plus a few specials, inside ``MoeConfig.tiny()``'s vocabulary of 272); :class:`HFChatTokenizer`
adapts a Hugging Face ``tokenizers`` file plus a jinja2 chat template for real models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable


@runtime_checkable
class ChatTokenizer(Protocol):
    vocab_size: int
    pad_id: int
    stop_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    def initial_prompt(self, text: str, system: str | None = None) -> list[int]: ...
    def observation(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then specials; ``vocab_size`` 272 (ids 262..271 unused).

    Format: ``<bos> [<system> sys] <user> text <assistant>`` → the model writes ``action <eos>``;
    each observation is ``<user> text <assistant>``.
    """

    BOS, EOS, PAD, USER, ASSISTANT, SYSTEM = 256, 257, 258, 259, 260, 261
    SPECIALS = {"<bos>": 256, "<eos>": 257, "<pad>": 258, "<user>": 259, "<assistant>": 260,
                "<system>": 261}
    vocab_size = 272

    def __init__(self):
        self.bos_id, self.eos_id, self.pad_id = self.BOS, self.EOS, self.PAD
        self.stop_token_ids = (self.EOS,)
        self._names = {v: k for k, v in self.SPECIALS.items()}

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text: got {type(text).__name__}, expected str")
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, raw = [], bytearray()
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i}: expected an id in [0, vocab_size={self.vocab_size})")
            if i < 256:
                raw.append(i)
                continue
            out.append(raw.decode("utf-8", errors="replace"))
            raw = bytearray()
            if not skip_special_tokens:
                out.append(self._names.get(i, f"<unused{i}>"))
        out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)

    def initial_prompt(self, text: str, system: str | None = None) -> list[int]:
        head = [self.BOS] + ([self.SYSTEM] + self.encode(system) if system else [])
        return head + self.observation(text)

    def observation(self, text: str) -> list[int]:
        return [self.USER] + self.encode(text) + [self.ASSISTANT]

    def chat_ids(self, messages: Sequence[dict]) -> list[int]:
        """A conversation ``[{role, content}]`` in this format: ``<bos>``, then a system message as
        ``<system> text``, a user or tool message as ``<user> text <assistant>`` (so one ending the
        list is the generation prompt), an assistant message as ``text <eos>``. ``[system, user]``
        gives :meth:`initial_prompt`'s ids, each later ``user`` :meth:`observation`'s."""
        ids = [self.BOS]
        for m in messages:
            text = self.encode(m["content"])
            if m["role"] == "system":
                ids += [self.SYSTEM] + text
            elif m["role"] == "assistant":
                ids += text + [self.EOS]
            else:
                ids += self.observation(m["content"])
        return ids


def _render_env():
    # transformers renders chat templates in the same sandbox with the same two helpers.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    env.globals["raise_exception"] = raise_exception
    return env


def render_chat(template, messages: list[dict], add_generation_prompt: bool, *, bos_token: str | None,
                eos_token: str | None, tools: list | None = None) -> str:
    """A compiled chat template (``_render_env().from_string``) applied to ``messages`` (and ``tools``,
    when given), as transformers' ``apply_chat_template`` does (text, not tokens)."""
    extra = {} if tools is None else {"tools": tools}
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos_token or "", eos_token=eos_token or "", **extra)


def compile_template(text: str):
    """A chat template's jinja2 source compiled in transformers' sandbox."""
    return _render_env().from_string(text)


# Dummy turns used to cut the template into pieces; their text never reaches the model.
_U0, _A0, _U1 = "\x00u0\x00", "\x00a0\x00", "\x00u1\x00"


class HFChatTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` plus a jinja2 chat template, rendered in pieces.

    The observation piece is cut from renders of a fixed dummy dialogue
    ``[user, assistant, user]``: the text after the assistant's stop token and up to the next
    generation prompt. If the template does not render that dialogue as an extension of its shorter
    prefix (it rewrites history, e.g. strips earlier reasoning), construction fails, because routes
    recorded for earlier turns could not stay aligned with a re-rendered prompt.
    """

    def __init__(self, tokenizer: Any, chat_template: str, *, eos_token: str,
                 bos_token: str | None = None, pad_token: str | None = None, vocab_size: int | None = None):
        self.tok = tokenizer
        self.template = _render_env().from_string(chat_template)
        self.bos_token, self.eos_token = bos_token, eos_token
        eos = tokenizer.token_to_id(eos_token)
        if eos is None:
            raise ValueError(f"eos_token={eos_token!r}: not in the tokenizer's vocabulary")
        self.eos_id = eos
        self.stop_token_ids = (eos,)
        pad = tokenizer.token_to_id(pad_token) if pad_token else None
        self.pad_id = eos if pad is None else pad
        self.vocab_size = tokenizer.get_vocab_size() if vocab_size is None else vocab_size
        # turn_end: template text closing an assistant turn (starts with the stop token)
        self.turn_end, self._obs_head, self._obs_tail = self._pieces()

    @classmethod
    def from_file(cls, tokenizer_json: str | Path, chat_template: str | None = None, *,
                  eos_token: str | None = None, **kw) -> "HFChatTokenizer":
        """Load ``tokenizer.json``; template and special tokens default to the
        ``tokenizer_config.json`` next to it (its ``chat_template``, ``eos_token``, ``bos_token``)."""
        from tokenizers import Tokenizer

        path = Path(tokenizer_json)
        if not path.is_file():
            raise ValueError(f"tokenizer_json={str(path)!r}: no such file")
        cfg_path = path.with_name("tokenizer_config.json")
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        tok_name = lambda v: v.get("content") if isinstance(v, dict) else v
        chat_template = chat_template or cfg.get("chat_template")
        if not isinstance(chat_template, str):
            raise ValueError(f"chat_template: none given and {str(cfg_path)!r} has no string "
                             f"'chat_template'; pass chat_template=...")
        eos_token = eos_token or tok_name(cfg.get("eos_token"))
        if not eos_token:
            raise ValueError("eos_token: none given and tokenizer_config.json has none")
        kw.setdefault("bos_token", tok_name(cfg.get("bos_token")))
        kw.setdefault("pad_token", tok_name(cfg.get("pad_token")))
        return cls(Tokenizer.from_file(str(path)), chat_template, eos_token=eos_token, **kw)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The template applied to ``messages`` (text, not tokens)."""
        return render_chat(self.template, messages, add_generation_prompt, bos_token=self.bos_token,
                           eos_token=self.eos_token)

    def _pieces(self) -> tuple[str, str, str]:
        u0, a0, u1 = ({"role": r, "content": c} for r, c in
                      (("user", _U0), ("assistant", _A0), ("user", _U1)))
        gen0 = self.render([u0], True)
        done0 = self.render([u0, a0], False)
        gen1 = self.render([u0, a0, u1], True)
        if not done0.startswith(gen0 + _A0):
            raise ValueError("chat template: rendering [user, assistant] does not extend the "
                             "rendering of [user] + generation prompt + the reply; the template "
                             "rewrites history, so per-turn routes cannot stay aligned (R3)")
        if not gen1.startswith(done0):
            raise ValueError("chat template: rendering [user, assistant, user] does not extend "
                             "the rendering of [user, assistant]; the template rewrites history, "
                             "so per-turn routes cannot stay aligned (R3)")
        tail = done0[len(gen0) + len(_A0):]  # e.g. "<|im_end|>\n"
        if not tail.startswith(self.eos_token):
            raise ValueError(f"chat template: the assistant turn ends with {tail!r}, expected it "
                             f"to start with eos_token={self.eos_token!r} (the stop token)")
        obs = tail[len(self.eos_token):] + gen1[len(done0):]
        head, sep, rest = obs.partition(_U1)
        if not sep:
            raise ValueError("chat template: the user message text does not appear verbatim")
        return tail, head, rest

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text: got {type(text).__name__}, expected str")
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def initial_prompt(self, text: str, system: str | None = None) -> list[int]:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return self.encode(self.render(msgs, True))

    def chat_ids(self, messages: Sequence[dict]) -> list[int]:
        """A conversation ``[{role, content}]`` rendered by the chat template with the generation prompt."""
        return self.encode(self.render(list(messages), True))

    def observation(self, text: str) -> list[int]:
        return self.encode(self._obs_head + text + self._obs_tail)
