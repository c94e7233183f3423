"""Chats kept across kernels: ``%vllm_mlx save-cache NAME [SESSION]``, ``load-cache NAME`` and
``fork SESSION NEW``.

Saving writes two files in ``<user cache>/saved/`` (``$VLLM_MLX_CACHE``, else
``~/.cache/vllm_mlx``): ``NAME.prefix``, the KV blocks of the chat's conversation so far (a prefix
file: ``vllm_mlx/engine/prefix_file.py``), and ``NAME.chat.json``, its system prompt and messages.
Loading, in this kernel or a later one with the same model, puts the blocks back into the cache
and the conversation back under the chat session ``NAME``, so its next ``%%generate --chat NAME``
turn starts from where it was and prefills only the new message. Forking copies a session's
history under a new name: both go on from the same blocks (the prefix cache shares them).

Tools are not saved (they may be Python functions): a loaded chat gets them with its next
``--tools``. A chat with images is refused (its images are not files of ours to keep).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from vllm_mlx_jupyter.session.prompt import ChatSession
from vllm_mlx_jupyter.session.session import SessionError

FORMAT = "vllm-mlx-chat"
VERSION = 1
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


@dataclass(frozen=True)
class SavedChat:
    """Where one saved chat's two files are."""

    name: str
    folder: Path

    @classmethod
    def named(cls, name: str, folder: Path | None = None) -> SavedChat:
        if not _NAME.fullmatch(name) or name.endswith("."):
            raise SessionError(f"save-cache/load-cache: {name!r} is not a name (letters, digits, '_', '-', '.')")
        if folder is None:
            from vllm_mlx.models.store import cache_root

            folder = cache_root() / "saved"
        return cls(name, folder)

    @property
    def prefix_path(self) -> Path:
        return self.folder / f"{self.name}.prefix"

    @property
    def chat_path(self) -> Path:
        return self.folder / f"{self.name}.chat.json"


def save_chat(session, saved: SavedChat, chat: ChatSession) -> int:
    """Write ``chat``'s KV and conversation; returns the tokens of KV saved."""
    from vllm_mlx.platform.atomic_file import write_atomically

    if chat.pending is not None and not chat.pending.done:
        raise SessionError(f"save-cache: chat {chat.name!r} has a turn still running; wait for it first")
    record = {"format": FORMAT, "version": VERSION, "system": chat.system, "messages": chat.messages,
              "turns": chat.turns}  # fmt: skip
    try:
        text = json.dumps(record, ensure_ascii=False, indent=1)
    except TypeError:
        raise SessionError(f"save-cache: chat {chat.name!r} holds images, which cannot be saved yet") from None
    tokens = session.chat_token_ids(chat.conversation(None))
    saved.folder.mkdir(parents=True, exist_ok=True)
    try:
        num_tokens = session.require_engine().save_prefix(tokens, saved.prefix_path)
    except ValueError as exc:
        raise SessionError(f"save-cache: {exc}") from None
    write_atomically(saved.chat_path, lambda temporary: temporary.write_text(text, encoding="utf-8"))
    return num_tokens


def load_chat(session, saved: SavedChat) -> tuple[ChatSession, int, str | None]:
    """The saved chat as a session named ``saved.name``, and the tokens of KV loaded (0, with the
    reason, when its prefix file cannot be used: the chat then recomputes its history)."""
    from vllm_mlx.engine.prefix_file import PrefixFileError

    try:
        record = json.loads(saved.chat_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SessionError(f"load-cache: no saved chat {saved.name!r} in {saved.folder}") from None
    except (OSError, ValueError) as exc:
        raise SessionError(f"load-cache: {saved.chat_path} is damaged: {exc}") from None
    if not _is_chat_record(record):
        raise SessionError(f"load-cache: {saved.chat_path} is not a saved chat of this version")
    chat = ChatSession(saved.name, record["system"], None, record["messages"], record["turns"])
    try:
        num_tokens, why = session.require_engine().load_prefix(saved.prefix_path), None
    except (PrefixFileError, ValueError) as exc:
        num_tokens, why = 0, str(exc)
    return chat, num_tokens, why


def fork_chat(chat: ChatSession, name: str) -> ChatSession:
    """A new session ``name`` with ``chat``'s history (no turn of its own yet)."""
    return ChatSession(name, chat.system, chat.tools, [dict(m) for m in chat.messages], chat.turns)


def _is_chat_record(record) -> bool:
    return (
        isinstance(record, dict)
        and record.get("format") == FORMAT
        and record.get("version") == VERSION
        and isinstance(record.get("messages"), list)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in record["messages"])
        and (record.get("system") is None or isinstance(record["system"], str))
        and isinstance(record.get("turns"), int)
    )
