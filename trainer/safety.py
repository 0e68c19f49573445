"""Unsafe inputs: config ``_target_`` paths, secrets in logs and saved files, pickled files.

Three rules, each enforced in one place:

1. **``_target_`` allowlist.** Hydra's ``instantiate`` imports and calls whatever dotted path a config names,
   so ``optim.optimizer._target_=os.system`` on a command line (or in a shared sweep file) would run it.
   Every ``_target_`` anywhere in the composed config is resolved (importing nothing outside an allowed
   prefix, and failing when a step of the path is a module, so ``torch.optim.optimizer.torch.serialization.
   shutil.copyfile`` cannot reach ``shutil``) and the object compared by identity with the built-in allowlist
   (torch's optimizers and schedulers); ``to_job_config`` checks this before anything is instantiated, and
   ``trainer.cli.check_code_sources`` checks Hydra's own ``hydra.callbacks`` / ``launcher`` / ``sweeper``
   before Hydra starts. Users allow their own objects with ``PACKFSDP_ALLOWED_TARGETS`` (comma-separated
   prefixes of the objects' own module names, e.g. ``mylib.optim.``) or ``allow_targets("mylib.optim.")`` from
   a plugin. The allowlist is deliberately not a config key: an override that could extend it could also
   use it.
2. **Secrets never leave the process.** Values of secret-looking environment variables (``WANDB_API_KEY``,
   ``HF_TOKEN``, anything named ``*_TOKEN``, ``*_KEY``, ``*_SECRET``, ``*_PASSWORD``), values of config keys
   named like secrets (``secret_key``: ``token``, ``*_token``, ``api_key``, ``password``, ...; not
   ``token_budget``) and token-shaped strings are replaced by ``***`` in every log line (a filter on the root
   handler), in the saved ``config.yaml``, a sweep's ``multirun.yaml`` and run-folder names, in error lines,
   in the config handed to wandb and in the command line wandb records.
3. **No pickle from disk.** Tensors are loaded in one home, ``trainer.checkpoint.safe_load``:
   ``load_tensor_file`` reads safetensors, or ``torch.load`` with ``weights_only=True`` (a pickle that names
   anything but tensors and plain containers is refused with an ``UnsafeFileError`` line naming the file), and
   ``load_tensors`` fills a state dict from a DCP checkpoint with a restricted unpickler.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import types
from typing import Any

from trainer.config import ConfigError

BUILTIN_TARGET_PREFIX = "torch.optim."
"""Where the objects of ``builtin_targets`` live (the paths a shipped config may name)."""
ALLOWED_TARGET_PREFIXES: list[str] = [BUILTIN_TARGET_PREFIX]
"""``_target_`` prefixes: the built-in one, then those plugins add with ``allow_targets``."""

# Refused even under an allowed prefix (a user who allows "torch." still cannot reach torch.load).
DENIED_TARGETS = re.compile(
    r"^(builtins|os|posix|sys|subprocess|shutil|pickle|marshal|importlib|runpy|socket|ctypes|pty|code"
    r"|torch\.(load|hub|package|jit\.load|utils\.cpp_extension|serialization)|numpy\.load|pandas\.read_pickle)(\.|$)"
    r"|(^|\.)(eval|exec|compile|__import__|getattr|setattr|system|popen|load)$"
)


class UnsafeTargetError(ConfigError):
    """A config names a ``_target_`` outside the allowlist."""


class UnsafeFileError(ValueError):
    """A file would need unpickling arbitrary objects to load."""


def allow_targets(*prefixes: str) -> None:
    """Extend the ``_target_`` allowlist (for plugins that register their own optimizers or sources)."""
    ALLOWED_TARGET_PREFIXES.extend(p for p in prefixes if p and p not in ALLOWED_TARGET_PREFIXES)


def allowed_target_prefixes() -> list[str]:
    extra = [p.strip() for p in os.environ.get("PACKFSDP_ALLOWED_TARGETS", "").split(",") if p.strip()]
    return [*ALLOWED_TARGET_PREFIXES, *extra]


@functools.cache
def builtin_targets() -> frozenset[Any]:
    """The objects a shipped config may instantiate: torch's optimizers and learning-rate schedulers."""
    import torch.optim  # noqa: PLC0415 -- the command line's checks import this module, and torch only when a target needs it
    from torch.optim import lr_scheduler  # noqa: PLC0415 -- with torch.optim above

    bases = (torch.optim.Optimizer, lr_scheduler.LRScheduler)
    return frozenset(
        obj
        for module in (torch.optim, lr_scheduler)
        for obj in vars(module).values()
        if isinstance(obj, type) and issubclass(obj, bases)
    )


def locate_target(name: str) -> Any:
    """The object a dotted path names, found as Hydra finds it (import the longest module prefix, then
    attributes), except that an attribute that is itself a module fails: ``torch.optim.optimizer.torch.
    serialization.shutil.copyfile`` would otherwise reach ``shutil`` through modules' imports."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        break
    else:
        raise LookupError(f"no module in {name!r} can be imported")
    for attr in parts[cut:]:
        obj = getattr(obj, attr, None)
        if obj is None:
            raise LookupError(f"{name!r} names nothing ({attr!r} is missing)")
        if isinstance(obj, types.ModuleType):
            raise LookupError(f"{name!r} reaches module {obj.__name__} through an attribute")
    return obj


def check_target(
    key: str, target: Any, allowed: frozenset[Any] | None = None, builtin_prefix: str = BUILTIN_TARGET_PREFIX
) -> Any:
    """Resolve ``target`` and return the object, or raise ``UnsafeTargetError``. Allowed: an object of
    ``allowed`` (default: ``builtin_targets()``) compared by identity, or an object whose own name (module and
    qualified name) lies under a prefix the user allowed (``PACKFSDP_ALLOWED_TARGETS``, ``allow_targets``).
    Nothing outside the allowed prefixes is imported to find out. ``builtin_prefix``: where ``allowed`` lives
    (Hydra's own launcher and sweeper for ``hydra.*`` keys, ``logging.`` for logging factories)."""
    user_prefixes = tuple(p for p in allowed_target_prefixes() if p != BUILTIN_TARGET_PREFIX)
    prefixes = [builtin_prefix, *user_prefixes]
    name = str(target)

    def refuse(why: str = "") -> UnsafeTargetError:
        return UnsafeTargetError(
            f"{key}={name!r} is not allowed{why} (allowed prefixes: {', '.join(prefixes)}); to allow your own, "
            f"set PACKFSDP_ALLOWED_TARGETS=your.module."
        )

    if DENIED_TARGETS.search(name) or not name.startswith(tuple(prefixes)):
        raise refuse()
    try:
        obj = locate_target(name)
    except LookupError as e:
        raise refuse(f": {e}") from None
    if obj in (builtin_targets() if allowed is None else allowed):
        return obj
    if isinstance(obj, types.ModuleType):
        raise refuse(": it is a module")
    own_name = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
    if DENIED_TARGETS.search(own_name) or not user_prefixes or not own_name.startswith(user_prefixes):
        raise refuse(f": it is {own_name}")
    return obj


def check_targets(
    tree: Any,
    path: str = "",
    allowed: frozenset[Any] | None = None,
    builtin_prefix: str = BUILTIN_TARGET_PREFIX,
    keys: tuple[str, ...] = ("_target_",),
) -> list[str]:
    """Check every ``_target_`` (or other ``keys`` naming a callable) in a nested dict/list, before anything is
    instantiated. Returns the targets that are user code (allowed by the user's prefixes), for the run's log."""
    user: list[str] = []
    builtin = builtin_targets() if allowed is None else allowed
    if isinstance(tree, dict):
        for key, value in tree.items():
            where = f"{path}.{key}" if path else str(key)
            if key in keys and isinstance(value, str):
                if check_target(where, value, builtin, builtin_prefix) not in builtin:
                    user.append(value)
            else:
                user += check_targets(value, where, allowed, builtin_prefix, keys)
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            user += check_targets(value, f"{path}[{i}]", allowed, builtin_prefix, keys)
    return user


def user_code(job: dict) -> list[str]:
    """The user or remote code a (plain-dict) job config imports, for the one line each run logs."""
    found = [f"data.plugins {p}" for p in job["data"]["plugins"]]
    if job["model"]["trust_remote_code"]:
        found.append(f"model.trust_remote_code (the code of {job['model']['name_or_path']})")
    return found + [f"_target_ {t}" for t in check_targets(job)]


# --------------------------------------------------------------------------------------------------- secrets
SECRET_ENV_NAMES = re.compile(r"(TOKEN|API_KEY|_KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
_SECRET_WORDS = {"secret", "password", "passwd", "credential", "credentials", "apikey", "authorization"}
_KEY_OWNERS = {"api", "access", "private", "secret", "auth", "hub", "hf", "wandb", "openai", "ssh", "encryption"}
_TOKENIZER_TOKENS = {"bos", "eos", "pad", "unk", "sep", "cls", "mask"}
# Token shapes worth catching even when they do not come from the environment.
SECRET_PATTERNS = re.compile(
    r"\bhf_[A-Za-z0-9]{20,}\b"  # Hugging Face user access tokens
    r"|\b(?:sk|pk|rk)-[A-Za-z0-9_-]{20,}\b"  # common `sk-...` API keys
    r"|\b(?:ghp|gho|ghs|github_pat)_[A-Za-z0-9_]{20,}\b"  # GitHub tokens
    r"|(?<=://)[^/\s:@]+:[^/\s@]+(?=@)"  # user:password@ in URLs
)
REDACTED = "***"
_MIN_SECRET_LEN = 6  # shorter values ("1", "true") would redact ordinary words


def secret_key(name: str) -> bool:
    """Whether a config key (its last dotted part) names a secret: ``token`` or ``*_token`` (not a tokenizer's
    ``pad_token``), ``api_key``-style ``*_key``, or a word like ``secret`` / ``password`` anywhere. Keys that
    merely contain "token" (``token_budget``, ``tokenizer_vocab_size``) are settings, not secrets."""
    parts = re.split(r"[_\-]+", str(name).rsplit(".", 1)[-1].lower())
    if _SECRET_WORDS & set(parts):
        return True
    last, before = parts[-1], parts[-2] if len(parts) > 1 else ""
    if last == "token":
        return before not in _TOKENIZER_TOKENS
    return last == "key" and before in _KEY_OWNERS


# ``key=value`` / ``key: value`` where the key names a secret (command lines, Hydra's sweep logs and files).
_SECRET_ASSIGNMENT = re.compile(r"(?P<key>[\w.+~-]+)(?P<sep>=|: )(?P<value>[^\s,'\"\]}]+)")


def _redact_assignment(match: re.Match) -> str:
    if not secret_key(match["key"].lstrip("+~")) or match["value"] in ("null", "None", "", REDACTED):
        return match[0]
    return f"{match['key']}{match['sep']}{REDACTED}"


def secret_values() -> list[str]:
    """Values of secret-looking environment variables, longest first (read each time: keys may be set late)."""
    values = {v for k, v in os.environ.items() if SECRET_ENV_NAMES.search(k) and len(v) >= _MIN_SECRET_LEN}
    return sorted(values, key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` with every known secret value and token-shaped string replaced by ``***``."""
    for value in secret_values():
        text = text.replace(value, REDACTED)
    text = _SECRET_ASSIGNMENT.sub(_redact_assignment, text)
    return SECRET_PATTERNS.sub(REDACTED, text)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters (an ESC from a data file's role or content would
    recolour, move or clear the user's terminal) shown as ``\\x1b``-style escapes; tabs and newlines kept."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def redact_tree(tree: Any) -> Any:
    """A copy of a nested dict/list with secret-named keys' values and secret strings redacted."""
    if isinstance(tree, dict):
        return {
            k: (REDACTED if secret_key(k) and v not in (None, "", False) else redact_tree(v)) for k, v in tree.items()
        }
    if isinstance(tree, (list, tuple)):
        return type(tree)(redact_tree(v) for v in tree)
    if isinstance(tree, str):
        return redact(tree)
    return tree


def redact_argv(argv: list[str]) -> list[str]:
    """Command-line arguments with secrets redacted, ``key=value`` overrides of secret-named keys included
    (wandb and others record ``sys.argv`` in their run files)."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        out.append(f"{key}={REDACTED}" if sep and value and secret_key(key) else redact(arg))
    return out


class RedactingFilter(logging.Filter):
    """Redacts each record's final message (arguments included) before any handler prints it."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            text = redact(str(exc))
            if text != str(exc):
                record.exc_info, record.exc_text = None, None
                record.msg = f"{record.msg}: {type(exc).__name__}: {text}"
        return True
