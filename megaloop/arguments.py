"""Command line derived from the config dataclasses.

Every concern (model, loop, parallelism, training, data, logging) is one dataclass whose fields
carry a docstring (a string literal right under the field, as megatron-core writes its configs).
This module turns those dataclasses into argparse flags, so the flag set, defaults and help text
are written exactly once. Flag names are the field names with ``-`` for ``_``; that gives
Megatron-LM's names where the field is named after Megatron-LM's flag.

Per-field ``metadata`` may refine the flag: ``choices``, ``nargs`` (lists), ``flag`` (an explicit
name when the field name cannot be the flag, e.g. ``bf16``), and three kinds of alias, so that a
Megatron-LM command line and a megaloop one that already shipped both parse:

- ``aliases``: more names for the same flag (``--muon-nesterov`` for ``--muon-use-nesterov``);
- ``value_aliases``: ``{spelling: value}`` for a choice with two names (``shape`` for
  ``shape_scaling``); the config only ever holds the canonical value;
- ``set_flags``: ``{flag: value}``, bare flags that set the field to a value (Megatron-LM's
  ``--sft`` is ``--data-format sft``).

``add_refused_flags`` adds flags of features megaloop does not have: they parse only to fail with
the reason, instead of "unrecognized arguments".
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import functools
import inspect
import re
import sys
import textwrap
import types
import typing
from typing import Any, Literal


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass, read from its source (including base classes)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in zip(body, body[1:] + [None]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def _unwrap_optional(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _choice(values: list, aliases: dict, convert):
    """argparse ``type`` for a choice that also accepts ``aliases`` (spelling -> value)."""
    def parse(text: str):
        return aliases[text] if text in aliases else convert(text)
    parse.__name__ = "choice"  # argparse names the type in its error message
    return parse


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type,
                       only: tuple[str, ...] = (), defaults: dict | None = None,
                       title: str | None = None) -> None:
    """Add one flag per field of ``cls`` to ``parser``, in a group named after the class.
    ``only``: just these fields (a tool that shares one flag with the trainer, e.g.
    ``--ckpt-step``, takes its definition from the trainer's dataclass). ``defaults``: field ->
    this parser's default (e.g. None for "not given", where a tool uses the flags only when
    some are passed); ``title``: the group's description instead of the class docstring's."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(
        cls.__name__, title or (cls.__doc__ or "").strip().split("\n")[0])
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("cli") is False or (only and f.name not in only):
            continue
        tp = _unwrap_optional(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        if defaults and f.name in defaults:
            default = defaults[f.name]
        doc = docs.get(f.name, "")
        # A docstring that says its default in words ("default: the checkpoint's") is not
        # followed by a second, literal one ("(default: None)").
        shown = doc if re.search(r"\(default\b|\bdefault:", doc) else \
            doc + f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": shown}
        if tp is bool:
            # A bare flag switches the default on, as Megatron-LM's store_true flags do;
            # `--flag false` is accepted so a script can pass an explicit value.
            kwargs.update(nargs="?", const=True, type=_parse_bool)
        elif typing.get_origin(tp) is Literal:
            kwargs.update(choices=list(typing.get_args(tp)), type=type(typing.get_args(tp)[0]))
        elif typing.get_origin(tp) in (list, tuple):
            (inner, *_) = typing.get_args(tp) or (str,)
            kwargs.update(nargs=f.metadata.get("nargs", "+"), type=_unwrap_optional(inner))
        else:
            kwargs.update(type=tp)
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        value_aliases = f.metadata.get("value_aliases")
        if value_aliases:
            # The alias is translated before argparse checks the choice; --help lists both.
            kwargs["type"] = _choice(kwargs.get("choices", []), value_aliases, kwargs["type"])
            kwargs["help"] += " Also accepted: " + ", ".join(
                f"{a} (= {v})" for a, v in value_aliases.items()) + "."
        aliases = list(f.metadata.get("aliases", ()))
        if aliases:
            kwargs["help"] += " Alias: " + ", ".join(aliases) + "."
        group.add_argument(flag_name(f), *aliases, **kwargs)
        for flag, value in f.metadata.get("set_flags", {}).items():
            group.add_argument(flag, dest=f.name, action="store_const", const=value,
                               default=default,
                               help=f"Same as {flag_name(f)} {value} (Megatron-LM's spelling).")


class _Refused(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is not supported: {self.help}")


def add_refused_flags(parser: argparse.ArgumentParser, title: str, refused: dict) -> None:
    """``refused``: flag -> one-line reason (what megaloop does not have, what to do instead).
    Each flag takes any number of values, so the error is the reason, whatever follows it."""
    group = parser.add_argument_group(title)
    for flag, reason in refused.items():
        group.add_argument(flag, action=_Refused, nargs="*", help=reason,
                           dest="refused_" + flag.lstrip("-").replace("-", "_"),
                           default=argparse.SUPPRESS)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error: a mistyped flag among a hundred would otherwise print the
    whole usage (about 115 lines) above the one line that matters. The line names the closest
    known flag and points to --help."""

    def error(self, message: str):
        hint = ""
        if message.startswith("unrecognized arguments:"):
            known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            unknown = [w.split("=", 1)[0] for w in message.split(":", 1)[1].split()
                       if w.startswith("-")]
            guesses = [f"{w} -> {m[0]}" for w in unknown
                       for m in [difflib.get_close_matches(w, known, n=1, cutoff=0.6)] if m]
            if guesses:
                hint = f" (did you mean: {', '.join(guesses)}?)"
        self.exit(2, f"{self.prog}: error: {message}{hint}; see {self.prog} --help\n")


class FlagErrors(ValueError):
    """Several refusals of one command line, each naming its flag. Every command prints a refusal
    as ``error: {exc}``; the messages are joined so that each gets its own ``error:`` line."""

    def __init__(self, messages: list[str]):
        self.messages = list(messages)
        super().__init__("\nerror: ".join(self.messages))


class FlagCheck:
    """Runs a command's independent flag checks and reports every refusal together, so a user
    fixes them in one edit instead of one per (slow) start::

        flags = FlagCheck()
        with flags.check():
            precision.validate()
        with flags.check():
            engine.validate()
        if flags.ok:  # a check that assumes the ones above passed
            with flags.check():
                check_speculate(...)
        flags.raise_any()
    """

    def __init__(self):
        self.messages: list[str] = []

    @property
    def ok(self) -> bool:
        return not self.messages

    @contextlib.contextmanager
    def check(self):
        try:
            yield
        except FlagErrors as exc:
            self.messages += exc.messages
        except ValueError as exc:
            self.messages.append(str(exc))

    def refused(self) -> bool:
        """Print every refusal as an ``error:`` line on stderr; whether there was any (the
        command then exits 2)."""
        for message in self.messages:
            print(f"error: {message}", file=sys.stderr)
        return not self.ok

    def raise_any(self) -> None:
        if len(self.messages) == 1:
            raise ValueError(self.messages[0])
        if self.messages:
            raise FlagErrors(self.messages)


def check_ranges(config, limits: dict) -> None:
    """``limits``: field name -> smallest allowed value; a field left at None is not checked.
    Raises ValueError naming the flag (a size of 0 otherwise surfaces as a ZeroDivisionError or
    an empty tensor deep inside megatron-core), every flag out of range at once."""
    fields = {f.name: f for f in dataclasses.fields(config)}
    flags = FlagCheck()
    for name, low in limits.items():
        value = getattr(config, name)
        if value is not None and value < low:
            flags.messages.append(f"{flag_name(fields[name])} {value} must be >= {low}")
    flags.raise_any()


def dataclass_from_args(cls: type, namespace: argparse.Namespace):
    """Build ``cls`` from the parsed namespace (fields not on the CLI keep their defaults)."""
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)
              if f.init and f.metadata.get("cli") is not False and hasattr(namespace, f.name)}
    return cls(**values)
