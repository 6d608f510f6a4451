"""``eagle-data`` command line: one static table of commands (jsonargparse).

Each command is a typed, documented function whose signature and docstring make its options;
``extract`` is the :class:`~eagle_data.extract.config.ExtractConfig` dataclass itself (its
fields and the docstring under each). Every command takes ``--config FILE.yaml`` (see
``configs/``) plus flags; flags win. Benchmarks are not installed: ``python -m benchmarks``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

from eagle_data.cli.data import extract, inspect, merge, regenerate, templates
from eagle_data.cli.train import demo, evaluate, export, serve_check, train, vocab
from eagle_data.cli.verify import verify
from eagle_data.extract.config import ExtractConfig
from eagle_data.regen.config import RegenerateConfig

#: command name -> function, or a dataclass whose instance a runner in :data:`RUNNERS` takes
COMMANDS: dict[str, Any] = {"extract": ExtractConfig, "regenerate": RegenerateConfig, "inspect": inspect,
                            "merge": merge, "verify": verify, "vocab": vocab, "train": train, "eval": evaluate,
                            "export": export, "demo": demo, "templates": templates,
                            "serve-check": serve_check}
#: what to do with a parsed dataclass command
RUNNERS: dict[type, Callable[[Any], None]] = {ExtractConfig: extract, RegenerateConfig: regenerate}


def run_cli(commands: dict[str, Any], argv: list[str] | None, prog: str,
            runners: dict[type, Callable[[Any], None]] | None = None,
            interrupted: str = "interrupted; rerun the same command to resume") -> None:
    """Parse ``argv`` against ``commands`` and run the chosen one.

    Bad data or settings (``ValueError``) end with exit code 2 and the message, a failing file
    system or machine (``OSError``: full disk, missing file) with 1 (no traceback unless
    ``EAGLE_DATA_TRACEBACK=1``); Ctrl-C / an interrupted extraction with 130 and ``interrupted``.
    """
    from argparse import ArgumentError

    from jsonargparse import CLI, set_parsing_settings

    argv = list(argv if argv is not None else sys.argv[1:])
    if (typo := unknown_option(commands, argv, prog) or loose_boolean(commands, argv, prog)) is not None:
        print(f"error: {typo}", file=sys.stderr)
        sys.exit(2)
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        # no abbreviated options: a removed flag (e.g. --write_queue) must not silently mean a longer one
        try:  # a parsing error in a few lines, not jsonargparse's whole usage
            res = CLI(commands, args=argv, prog=prog, allow_abbrev=False, exit_on_error=False)
        except ArgumentError as e:
            cmd = f"{prog} {argv[0]}" if argv and argv[0] in commands else prog
            print(f"error: {usage_error(str(e), cmd, positionals(commands, argv))}", file=sys.stderr)
            sys.exit(2)
        if type(res) in (runners or {}):
            runners[type(res)](res)
    except KeyboardInterrupt:  # Ctrl-C / ExtractionInterrupted: state is consistent, rerun resumes
        print(interrupted, file=sys.stderr)
        sys.exit(130)
    except ValueError as e:  # bad data or settings: the message says what and where
        _fail(e, 2)
    except OSError as e:  # the file system or the machine (full disk, missing file): no traceback either
        _fail(e, 1)


def unknown_option(commands: dict[str, Any], argv: list[str], prog: str) -> str | None:
    """One line naming the first ``--option`` that ``argv``'s command does not take, with the
    closest it does (jsonargparse would print the whole usage, no suggestion); ``None`` if all
    are known. ``--model.lr`` counts as ``--model``."""
    import dataclasses
    import difflib
    import inspect

    if not argv or argv[0] not in commands:
        return None
    target = commands[argv[0]]
    names = ({f.name for f in dataclasses.fields(target)} if dataclasses.is_dataclass(target)
             else set(inspect.signature(target).parameters)) | {"config", "help", "print_config"}
    given_by_position = positionals(commands, argv)
    for arg in argv[1:]:
        if arg == "--":
            break
        name = arg[2:].split("=", 1)[0].split(".", 1)[0].removesuffix("+") if arg.startswith("--") else None
        if name in given_by_position:  # "--drafter x": jsonargparse says only "unrecognized arguments"
            usage = " ".join(a.upper() for a in given_by_position)
            return (f"{prog} {argv[0]}: {name.upper()} is given by position, not as --{name}: "
                    f"{prog} {argv[0]} {usage} [options]")
        if name and name not in names:
            near = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
            return (f"{prog} {argv[0]}: unknown option --{name}" + (f"; did you mean --{near[0]}?" if near else "")
                    + f" ({prog} {argv[0]} --help lists them)")
    return None


def loose_boolean(commands: dict[str, Any], argv: list[str], prog: str) -> str | None:
    """One line naming a boolean option given another word than true/false (YAML reads ``yes``,
    ``on`` as true: ``--trust_remote_code yes`` ran remote code); ``None`` if there is none."""
    import typing

    if not argv or argv[0] not in commands:
        return None
    target = commands[argv[0]]
    try:
        hints = typing.get_type_hints(target if isinstance(target, type) else target)
    except Exception:  # an annotation this Python cannot evaluate: jsonargparse decides
        return None
    flags = {k for k, t in hints.items() if t is bool}
    for i, arg in enumerate(argv[1:], 1):
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name in flags:
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if value.lower() not in ("true", "false"):
                return f"{prog} {argv[0]}: --{name} {value}: write true or false ({prog} {argv[0]} --help lists the options)"
    return None


def positionals(commands: dict[str, Any], argv: list[str]) -> list[str]:
    """The positional arguments of ``argv``'s command (a function's parameters without a default)."""
    import inspect

    target = commands.get(argv[0]) if argv else None
    if target is None or isinstance(target, type):
        return []
    return [n for n, p in inspect.signature(target).parameters.items() if p.default is inspect.Parameter.empty]


def usage_error(msg: str, cmd: str, args: list[str] = ()) -> str:
    """jsonargparse's message for a value of the wrong type, in one line: the option, the value
    and what it must be (``--dtype bf16: not one of bfloat16, float32, float16``); others joined."""
    import re

    required = re.search(r"the following arguments are required: (.*)$", msg, re.M)
    if required:  # positional arguments, named as "serve-check.drafter": users then tried --drafter
        names = " ".join(n.strip().rsplit(".", 1)[-1].upper() for n in required.group(1).split(","))
        usage = " ".join(a.upper() for a in args) or names
        return f"{cmd}: missing {names}: give them first, by position: {cmd} {usage} [options] ({cmd} --help)"
    key, choices = re.match(r'Parser key "([^"]+)":', msg), re.search(r"Literal\[([^\]]*)\]", msg)
    given = re.search(r"(?:Given|Got) value: (.*)$", msg, re.M)
    subtypes = re.search(r"Subtypes: \[(.*)\]$", msg, re.M)
    if key and given and subtypes and not choices:  # a Union of other types: its members, plainly
        kinds = re.sub(r"<class '(\w+)'>", r"\1", subtypes.group(1)).replace("NoneType", "null")
        msg = f"--{key.group(1)} {given.group(1)}: expected {kinds.replace(', ', ' or ')}"
    elif key and given:
        body = re.split(r"\.?\s*(?:Given value type|Given value|Got value):", msg.split(":", 1)[1])[0]
        what = (f"not one of {choices.group(1).replace(chr(39), '')}" + (" (or null)" if "NoneType" in msg else "")
                if choices else re.sub(r"<class '(\w+)'>", r"\1", body).replace("Expected a", "expected"))
        msg = f"--{key.group(1)} {given.group(1)}: {what}"
    return f"{cmd}: {' '.join(msg.split())} ({cmd} --help lists the options)"


def _fail(e: BaseException, code: int) -> None:
    if os.environ.get("EAGLE_DATA_TRACEBACK"):
        raise e
    print(f"error: {e}\n(set EAGLE_DATA_TRACEBACK=1 for the traceback)", file=sys.stderr)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    from eagle_data.cli.train import grouped_print_config, model_group_fields, train_option_problem

    argv = list(sys.argv[1:] if argv is None else argv)
    if (typo := train_option_problem(argv)) is not None:  # --data.batch_sise: now, not after torch loads
        print(f"error: {typo}", file=sys.stderr)
        sys.exit(2)
    with grouped_print_config(argv):
        run_cli(COMMANDS, model_group_fields(argv), "eagle-data", RUNNERS)


if __name__ == "__main__":
    main()
