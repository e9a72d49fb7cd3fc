"""Command-line plumbing shared by ``spar-build`` and ``spar-probe``.

* :class:`LazyGroup`: a click group whose subcommands are ``"module:attr"`` strings,
  imported only when that subcommand runs (``spar-build --help`` imports no torch).
* :func:`run_cli`: runs a group and turns :class:`~spar_bench.errors.SparError` (an unknown
  registry name included) and a full disk anywhere (:func:`spar_bench.outputs.disk_full_error`)
  into one newline-terminated line on stderr instead of a traceback.
* :func:`run_main`: the console scripts' entry: SIGTERM runs every cleanup (no worker
  process outlives the command) and a full disk exits at once after its one line.
* :func:`old_spelling`: a renamed option's old flag, hidden, still filling the new parameter.
* :class:`LazyHelpOption`: an option whose help text is made when ``--help`` shows it.
* :func:`wait_option`: ``--wait [SECONDS]``, every writer's way to wait for another writer of
  its output (:mod:`spar_bench.locks`) instead of being refused.

Exit status (docs/USAGE.md, "exit codes"), the same for ``spar-build`` and ``spar-probe``: 0 ok;
1 a run failed (:class:`~spar_bench.errors.RunFailed`); 2 a usage or input error (click's
usage errors, every other :class:`~spar_bench.errors.SparError`, a full disk); 130 SIGINT
(Ctrl-C); 143 SIGTERM.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import click
from click.core import ParameterSource

from spar_bench.errors import ConfigError, RunFailed, SparError
from spar_bench.fields import field_default, field_types, help_of, limit_of, scalar
from spar_bench.registry import import_target


class LazyGroup(click.Group):
    def __init__(self, *args, lazy_commands: Mapping[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy_commands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_commands:
            cmd = import_target(self.lazy_commands[cmd_name])
            if not isinstance(cmd, click.Command):
                raise TypeError(f"{self.lazy_commands[cmd_name]!r} is not a click command")
            return cmd
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:
            import difflib

            name = args[0] if args else ""
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=2)
            if close and "No such command" in str(e):
                raise click.UsageError(f"{e.message} Did you mean {' or '.join(close)}?", ctx) from None
            raise


def error_line(e: BaseException) -> str:
    """``error: <message>`` on one line (a message's own line breaks become spaces)."""
    return "error: " + " ".join(part.strip() for part in str(e).splitlines() if part.strip())


def _end_progress_bars() -> None:
    """Close the progress bars an error left open, so its line starts a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        try:
            bar.close()
        except Exception:  # noqa: BLE001 (a bar that cannot close must not hide the error)
            pass


def _out_option(argv: list[str] | None) -> str | None:
    """The command's ``--out`` (the output a full disk names when the error names no file)."""
    args = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(args):
        if arg == "--out" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--out="):
            return arg.split("=", 1)[1]
    return None


#: Exit status of a failed run (:class:`RunFailed`) and of a usage or input error.
EXIT_RUN_FAILED, EXIT_USAGE = 1, 2


def _hide_old_spellings(e: click.ClickException) -> None:
    """A mistyped option's "did you mean" leaves out the hidden options (the old spellings)."""
    ctx = getattr(e, "ctx", None)
    if not isinstance(e, click.NoSuchOption) or not e.possibilities or ctx is None:
        return
    hidden = {o for p in ctx.command.params if getattr(p, "hidden", False) for o in p.opts}
    e.possibilities = [o for o in e.possibilities if o not in hidden]  # type: ignore[misc]


def run_cli(group: click.Command, argv: list[str] | None = None, prog_name: str | None = None) -> int:
    """Run ``group``; a :class:`SparError` or a full disk becomes ``error: <message>`` and exit 2
    (1 for :class:`RunFailed`); Ctrl-C exits 130. ``prog_name``: the program its usage lines
    name (default: this process's, which inside ``spar-bench run`` is not ``group``'s)."""
    return _run(group, argv, prog_name)[0]


def _run(group: click.Command, argv: list[str] | None,
         prog_name: str | None = None) -> tuple[int, BaseException | None]:
    try:
        group.main(args=argv, standalone_mode=False, prog_name=prog_name)
    except click.exceptions.Exit as e:
        return e.exit_code, None
    except click.ClickException as e:
        _hide_old_spellings(e)
        e.show()
        return e.exit_code, e
    except click.Abort as e:
        click.echo("aborted", err=True)
        return 130, e
    except SparError as e:
        _end_progress_bars()
        click.echo(error_line(e), err=True)  # echo ends the line with a newline
        return (EXIT_RUN_FAILED if isinstance(e, RunFailed) else EXIT_USAGE), e
    except Exception as e:  # a full disk where no command caught it: the same one line
        from spar_bench.outputs import disk_full_error, is_disk_full

        if not is_disk_full(e):
            err = unwritable_error(e)
            if err is None:
                raise
            _end_progress_bars()
            click.echo(error_line(err), err=True)
            return EXIT_USAGE, err
        err = disk_full_error(e, _out_option(argv))
        _end_progress_bars()
        click.echo(error_line(err), err=True)
        return EXIT_USAGE, err
    except SystemExit as e:
        if e.code == 128 + signal.SIGTERM:  # from exit_on_sigterm, after every cleanup ran
            _end_progress_bars()
            click.echo("terminated (SIGTERM)", err=True)
        raise
    return 0, None


#: what a write refused by the file system is (a read-only mount, no permission)
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def unwritable_error(e: BaseException) -> ConfigError | None:
    """A file the file system refuses (read-only, no permission) as one line naming it; None for
    any other error (a bug's traceback stays one)."""
    if not (isinstance(e, OSError) and e.errno in _UNWRITABLE and e.filename):
        return None
    if e.errno == errno.EROFS:
        return ConfigError(f"{e.filename}: cannot be written ({e.strerror}); write elsewhere")
    return ConfigError(f"{e.filename}: {e.strerror}; check its permissions (and its folder's), or use another path")


def run_main(group: click.Command, argv: list[str] | None = None) -> NoReturn:
    """The console-script entry: :func:`run_cli` with SIGTERM as a clean exit, then exit.

    After a full disk the process leaves at once (``os._exit``): HDF5 would otherwise crash
    at interpreter exit closing a file whose last write failed, after the error was shown.
    """
    from spar_bench.outputs import DiskFullError
    from spar_bench.procs import exit_on_sigterm, interrupted, terminated

    exit_on_sigterm()
    code, err = _run(group, argv)
    if code == 0 and terminated():  # a SIGTERM whose SystemExit a finalizer swallowed
        _end_progress_bars()
        click.echo("terminated (SIGTERM)", err=True)
        code = 128 + signal.SIGTERM
    elif code == 0 and interrupted():  # a SIGINT whose KeyboardInterrupt a finalizer swallowed
        _end_progress_bars()
        click.echo("aborted", err=True)
        code = 128 + signal.SIGINT
    if isinstance(err, DiskFullError):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)



_GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def old_spelling(old: str, new: str, param: str, *, convert: Callable[[Any], Any] | None = None,
                 note: bool = False, **option_kw: Any) -> Callable[[Any], Any]:
    """Decorator (below ``@click.command``): ``old``, the spelling of option ``new`` before 0.2,
    hidden from ``--help`` and removed in 0.3, filling the command's parameter ``param``.

    ``option_kw`` are the old option's click settings (``type``, ``multiple`` ...). Given alone,
    its value (through ``convert``, where the old values are not the new option's: ``vqa
    --dtype float32`` is ``--compute fp32``) is ``param``'s, recorded as given on the command
    line (so a ``--preset`` does not override it), and with ``note`` a one-line deprecation note
    goes to stderr; given with ``new``: a :class:`~spar_bench.errors.ConfigError` (one line, exit 2).
    """
    hidden = f"_old_{old.lstrip('-').replace('-', '_')}"

    def decorate(f):
        @functools.wraps(f)
        def command(*args, **kw):
            value = kw.pop(hidden)
            ctx = click.get_current_context()
            ctx.params.pop(hidden, None)
            source = ctx.get_parameter_source(hidden)
            if source in _GIVEN:
                if ctx.get_parameter_source(param) in _GIVEN:
                    raise ConfigError(f"{old} and {new}: {old} is the old spelling of {new} "
                                      f"(renamed in 0.2); give {new} only")
                if note:
                    click.echo(f"note: {old} is deprecated (renamed {new} in 0.2, removed in 0.3); "
                               f"give {new}", err=True)
                value = value if convert is None else convert(value)
                kw[param] = ctx.params[param] = value
                ctx.set_parameter_source(param, source)
            return f(*args, **kw)

        help_text = f"Old spelling of {new} (renamed in 0.2, removed in 0.3)."
        return click.option(old, hidden, hidden=True, help=help_text, **option_kw)(command)

    return decorate


class LazyHelpOption(click.Option):
    """A :class:`click.Option` whose help text ``help_of()`` is made when ``--help`` shows it,
    not when its command is imported (it may read classes whose modules import torch)."""

    def __init__(self, *args: Any, help_of: Callable[[], str], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.help_of = help_of

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        self.help = self.help_of()
        return super().get_help_record(ctx)
def _wait_for_writers(ctx: click.Context, _param: click.Parameter, value: float | None) -> None:
    """``--wait``: the command's output locks wait up to ``value`` seconds (until it ends)."""
    if value is not None:
        from spar_bench.locks import waiting

        ctx.with_resource(waiting(value))


def wait_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--wait [SECONDS]``: another process writing this command's output is waited for (alone:
    as long as it takes; with SECONDS: that long at most) instead of refusing at once (one line,
    exit 2). The value reaches every :func:`spar_bench.locks.output_lock` the command takes
    (:func:`spar_bench.locks.wait_seconds`); the command gets no parameter for it."""
    import math

    return click.option("--wait", type=click.FloatRange(0), default=None, is_flag=False, flag_value=math.inf,
                        metavar="[SECONDS]", expose_value=False, callback=_wait_for_writers,
                        help="Wait for another process writing the same output (alone: until it "
                             "ends; SECONDS: at most that long) instead of stopping at once.")(f)  # fmt: skip


def declared_type(cls: type, name: str) -> click.ParamType:
    """The click type of settings field ``name`` of ``cls``, made from its one declaration
    (:func:`spar_bench.fields.limited`): a choice, an int or float range."""
    limit = limit_of(cls, name)
    if limit is None:
        raise TypeError(f"{cls.__name__}.{name} declares no limit")
    if limit.choices is not None:
        return click.Choice([str(c) for c in limit.choices])
    numbers = [x for x in (limit.lo, limit.hi) if x is not None]
    if all(float(x).is_integer() for x in numbers) and any(isinstance(x, int) for x in numbers):
        return click.IntRange(limit.lo, limit.hi)
    return click.FloatRange(limit.lo, limit.hi)


class FieldOption(click.Option):
    """An option that fills field ``field`` of dataclass ``config`` (:func:`field_option`): its
    default is None, the field holds it, and its help ends with it (a test compares every such
    option with its field). ``config`` may be a ``"module:Class"`` string, imported when the help
    or the default is first needed (a command line built without importing it)."""

    def __init__(self, *args: Any, config: type | str, field: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._config, self.field, self.text = config, field, self.help or ""
        if not isinstance(config, str):
            self.help = self.help_text()

    @property
    def config(self) -> type:
        if isinstance(self._config, str):
            self._config = import_target(self._config)
        return self._config

    def help_text(self) -> str:
        """The help: the text given (else the field's) and the field's default."""
        text = self.text or help_of(self.config, self.field) or ""
        return f"{text}  [default: {_shown(field_default(self.config, self.field))}]".strip()

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        self.help = self.help_text()
        return super().get_help_record(ctx)


def field_option(cls: type | str, name: str, *decls: str, help: str | None = None, fill: bool = False,
                 **click_kw: Any) -> Callable[[Callable], Callable]:
    """One click option (``decls``, default ``--name-spelled-so name``) filling field ``name`` of
    dataclass ``cls`` (:class:`FieldOption`), made from the field: its default ``None`` (so no
    default is written twice), its type from its limit (:func:`declared_type`) or its annotation
    unless ``click_kw`` gives one (it must, for a ``cls`` named ``"module:Class"``), its help
    ``help`` (else the field's, :func:`spar_bench.fields.limited`) ending with the field's default
    (``[default: 0.0001]``).

    ``fill``: a value not given is the field's default when the command reads it (a command that
    uses the value itself, before or instead of building ``cls``); else None reaches the command,
    whose dataclass fills it (:func:`given`)."""
    if "type" not in click_kw and not click_kw.get("is_flag"):
        click_kw["type"] = field_click_type(import_target(cls) if isinstance(cls, str) else cls, name)
    if fill:
        click_kw["callback"] = _filling(click_kw.get("callback"))
    decls = decls or (f"--{name.replace('_', '-')}", name)
    return click.option(*decls, cls=FieldOption, config=cls, field=name, default=None, help=help, **click_kw)


def field_click_type(cls: type, name: str) -> click.ParamType | None:
    """The click type of field ``name`` of ``cls``: from its limit (:func:`declared_type`) when it
    declares a range or choices, else from its annotation (None: taken as text)."""
    limit = limit_of(cls, name)
    if limit is not None and (limit.choices is not None or limit.lo is not None or limit.hi is not None):
        return declared_type(cls, name)
    return scalar(field_types(cls)[name])


def _filling(then: Callable | None) -> Callable:
    """A click callback: a :class:`FieldOption` not given is its field's default (as the option's
    type reads it), then ``then``."""

    def callback(ctx: click.Context, param: FieldOption, value: Any) -> Any:
        if value is None or (param.multiple and value == ()):
            default = field_default(param.config, param.field)
            value = param.type_cast_value(ctx, default if not param.multiple or isinstance(default, tuple)
                                          else (default,))  # fmt: skip
        return value if then is None else then(ctx, param, value)

    return callback


def field_options(cls: type, *names: str, helps: Mapping[str, str] | None = None,
                  types: Mapping[str, click.ParamType] | None = None) -> Callable[[Callable], Callable]:
    """One option per field ``names`` of dataclass ``cls`` (``--encoder-lr``; :func:`field_option`,
    default None: the dataclass fills in a value not given, :func:`given`), ``helps``: help where
    the field declares none; ``types``: a click type other than the field's."""
    def decorate(f: Callable) -> Callable:
        for name in reversed(names):
            kind = {"type": types[name]} if types and name in types else {}
            text = help_of(cls, name) or (helps or {}).get(name)
            f = field_option(cls, name, help=text, **kind)(f)
        return f

    return decorate


def _shown(default: Any) -> str:
    """A dataclass default as ``--help`` shows it (a tuple as its comma list)."""
    return ",".join(map(str, default)) if isinstance(default, tuple) else str(default)


def given(values: Mapping[str, Any]) -> dict[str, Any]:
    """The values a command line gave (not None): the rest is the dataclass's default."""
    return {k: v for k, v in values.items() if v is not None}
