"""Real human dialogues, offline: the BYU chit-chat challenge's conversations (``data.source=chitchat``).

The corpus ships as the ``chitchat-dataset`` package (``pip install -e .[chitchat]``; MIT; 7,168 conversations
in one JSON file, read here, never imported). ``data.path`` may name that JSON file instead (a copy of it).
The file maps a conversation id to a conversation::

    {"<id>": {"messages": [[{"text": "Hello", "sender": "<id>", "timestamp": "..."}, ...], ...],
              "prompt": "...", "ratings": {...}, "start": "..."}, ...}

``messages`` is a list of turns, each a list of messages. A conversation becomes one dialog record
``{"turns": [...]}`` (``trainer.data.render``: ``BOS t1 EOS t2 EOS ...``): its messages in order, consecutive
messages of one sender joined by a newline into one turn, so the turns alternate speakers. Empty messages
carry nothing and are left out of their turn (counted and logged); a conversation with no text at all is
the renderer's ``empty`` skip; a conversation that is not of this shape is a bad record (an error naming
it, or a counted skip under ``data.on_bad_record=skip``). Conversations keep the file's order.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

from trainer.config import ConfigError
from trainer.data.bad_records import BadRecords

log = logging.getLogger(__name__)

PACKAGE = "chitchat_dataset"
DATA_FILE = "dataset.json"
EXTRA = "chitchat"
"""The pyproject.toml extra that installs the package (``pip install -e .[chitchat]``)."""


def chitchat_file(path: str | None) -> Path:
    """The JSON file to read: ``data.path``, else the installed package's (found without importing it)."""
    if path:
        file = Path(path).expanduser()
        if not file.is_file():
            raise ConfigError(f"data.path={path}: no such file (data.source=chitchat reads the corpus' {DATA_FILE})")
        return file
    spec = importlib.util.find_spec(PACKAGE)
    file = Path(spec.origin).parent / DATA_FILE if spec is not None and spec.origin else None
    if file is None or not file.is_file():
        raise ConfigError(
            f"data.source=chitchat needs the chitchat-dataset package: pip install -e '.[{EXTRA}]' "
            f"(bash launch/setup_env.sh installs it), or set data.path to a copy of its {DATA_FILE}"
        )
    return file


def read_chitchat(file: Path, bad: BadRecords) -> list[list[str]]:
    """Every conversation of ``file`` as a list of turns of alternating speakers (see the module docstring)."""
    try:
        corpus = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        bad.bad(str(file), f"not a chit-chat JSON file ({type(e).__name__}: {str(e)[:200]})", "file")
        return []
    if not isinstance(corpus, dict):
        bad.bad(str(file), f"expected an object of id -> conversation, got {type(corpus).__name__}", "file")
        return []
    dialogs, empty_messages, one_speaker = [], 0, 0
    for conversation_id, conversation in corpus.items():
        try:
            messages = conversation_messages(conversation)
        except ValueError as e:
            bad.bad(f"{file} conversation {conversation_id}", str(e), "conversation")
            continue
        turns, empty = speaker_turns(messages)
        empty_messages += empty
        one_speaker += len(turns) == 1
        dialogs.append(turns)
    log.info(
        "data chitchat: %d conversations read from %s (%d with one speaker only: a single turn); "
        "%d empty messages left out",
        len(dialogs),
        file,
        one_speaker,
        empty_messages,
    )
    return dialogs


def conversation_messages(conversation: object) -> list[tuple[str, str]]:
    """A conversation's ``(sender, text)`` messages in order; ``ValueError`` naming what is malformed."""
    turns = conversation.get("messages") if isinstance(conversation, dict) else None
    if not isinstance(turns, list):
        raise ValueError("a conversation needs a 'messages' list of turns")
    messages = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, list):
            raise ValueError(f"turn {t} is not a list of messages")
        for m, message in enumerate(turn):
            text = message.get("text") if isinstance(message, dict) else None
            sender = message.get("sender") if isinstance(message, dict) else None
            if not isinstance(text, str) or not isinstance(sender, str):
                raise ValueError(f"turn {t} message {m} needs a string 'text' and 'sender'")
            messages.append((sender, text))
    return messages


def speaker_turns(messages: list[tuple[str, str]], joiner: str = "\n") -> tuple[list[str], int]:
    """``(turns, empty)``: consecutive non-empty messages of one sender joined into one turn (so turns
    alternate speakers), and how many empty messages were left out."""
    turns: list[str] = []
    last_sender, empty = None, 0
    for sender, text in messages:
        text = text.strip()
        if not text:
            empty += 1
        elif sender == last_sender:
            turns[-1] += joiner + text
        else:
            turns.append(text)
            last_sender = sender
    return turns, empty


__all__ = ["EXTRA", "chitchat_file", "conversation_messages", "read_chitchat", "speaker_turns"]
