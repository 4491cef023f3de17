"""A Hugging Face tokenizer folder (`tokenizer.json`, read with the `tokenizers` library) as a task
tokenizer (`rollout.tasks.Tokenizer`: vocab_size, pad_id, bos_id, eos_id, encode, decode).

    tok = HFTokenizer.load("path/to/Qwen3-8B")          # tokenizer.json + tokenizer_config.json
    ids = tok.encode("2+2=", bos=True)                   # bos only if the tokenizer has one
    text = tok.chat_prompt("What is 2+2?")               # the chat template, when the folder has one
    tok.save_pretrained("export/")                       # copies the files it was loaded from

Special tokens come from `tokenizer_config.json` (`eos_token`, `pad_token`, `bos_token`, each a string
or {"content": ...}; `special_tokens_map.json` is read too): eos is required; pad falls back to eos (a
padded slot is never attended to, so any id works); a tokenizer without bos (Qwen) has bos_id None and
`encode(bos=True)` adds nothing. `chat_template` (Jinja, in tokenizer_config.json or
chat_template.jinja) is rendered in a sandboxed Jinja environment, as transformers does, with one user
message and the generation prompt. Nothing is downloaded; nothing is executed but the template.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["HFTokenizer"]


def _token(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer:
    def __init__(self, tokenizer: _HFTokenizer, *, eos: str, pad: str | None, bos: str | None, chat_template=None):
        self._tok = tokenizer
        self.files: dict[str, Path] = {}  # name in a tokenizer folder -> the file `load` read
        ids = {}
        for role, token in (("eos", eos), ("pad", pad), ("bos", bos)):
            if token is not None:
                i = tokenizer.token_to_id(token)
                if i is None:
                    raise ValueError(f"tokenizer: {role}_token {token!r} is not in the vocabulary")
                ids[role] = i
        self.eos_id = ids["eos"]
        self.pad_id = ids.get("pad", self.eos_id)
        self.bos_id = ids.get("bos")
        self.eos_token, self.bos_token = eos, bos
        self.chat_template = chat_template
        self._special = {i for i in (self.eos_id, self.pad_id, self.bos_id) if i is not None}

    @classmethod
    def load(cls, path: str | Path) -> HFTokenizer:
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"task.tokenizer={str(path)!r}: no tokenizer.json there")
        try:
            tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # the Rust library raises its own exception type for a bad file
            raise ValueError(f"task.tokenizer: {file} is not a valid tokenizer.json: {e}") from None
        config: dict = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
            f = file.parent / name
            if f.is_file():
                try:
                    config.update(json.loads(f.read_text()))
                except json.JSONDecodeError as e:
                    raise ValueError(f"task.tokenizer: {f} is not valid JSON: {e}") from None
        eos = _token(config.get("eos_token"))
        if eos is None:
            raise ValueError(f"task.tokenizer: {file.parent} names no eos_token (tokenizer_config.json)")
        template = config.get("chat_template")
        jinja = file.parent / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()
        if template is not None and not isinstance(template, str):
            raise ValueError("task.tokenizer: only a single (string) chat_template is supported")
        out = cls(
            tok,
            eos=eos,
            pad=_token(config.get("pad_token")),
            bos=_token(config.get("bos_token")),
            chat_template=template,
        )
        names = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
        out.files = {"tokenizer.json": file, **{n: file.parent / n for n in names if (file.parent / n).is_file()}}
        return out

    def save_pretrained(self, path: str | Path) -> list[str]:
        """Copy the files this tokenizer was loaded from into the folder `path`; returns their names."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for name, f in self.files.items():
            shutil.copyfile(f, path / name)
        return list(self.files)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * (bos and self.bos_id is not None) + ids + [self.eos_id] * eos

    def decode(self, ids) -> str:
        """Text up to the first eos; special tokens dropped."""
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if i not in self._special and 0 <= i < self.vocab_size:
                out.append(int(i))
        return self._tok.decode(out, skip_special_tokens=True)

    def chat_prompt(self, user_message: str) -> str:
        """The chat template rendered for one user message, ending with the assistant's turn opening."""
        if self.chat_template is None:
            raise ValueError("task.chat_template is set but the tokenizer has no chat_template")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            return env.from_string(self.chat_template).render(
                messages=[{"role": "user", "content": user_message}],
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            raise ValueError(f"task.tokenizer: the chat template failed: {e}") from None
