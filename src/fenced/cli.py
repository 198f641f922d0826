"""The ``fenced`` command."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import lru_cache, partial, wraps
from typing import Annotated, Any, NoReturn

try:
    import typer
except ImportError:  # pragma: no cover - exercised only without the extra
    typer = None  # type: ignore[assignment]

import redis

from . import __version__, _beat
from ._audit import echo_to_stderr
from ._client import client_from_setting, connect, parse_url, redact
from ._errors import ClaimUnavailable, ConfigError
from ._inspect import (
    beat_status,
    clear_queued,
    force_release,
    list_claims,
    list_queued,
    operator,
    read_holder,
    read_slots,
    release_slot,
    show_claim,
)
from ._lease import UNREACHABLE, check_namespace, describe_client, short_token, why_unreachable
from ._options import DEFAULT, HELP, ClaimOptions, closest
from ._printable import printable
from ._run import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    ON_BUSY,
    ON_BUSY_ALIASES,
    RUN_CLAIM_OPTIONS,
    RunOptions,
    run_command,
)

app = (
    typer.Typer(
        no_args_is_help=True,
        add_completion=False,
        rich_markup_mode=None,
        # A crash's traceback must not print the Redis URL (and its password) from the
        # frames' locals, which older typer versions show by default.
        pretty_exceptions_show_locals=False,
    )
    if typer
    else None
)

#: The width of `ls` and `show` output sent to a pipe or a file: no value wraps.
PIPED_WIDTH = 4096
#: Exit status when a command refuses to act (e.g. ``release`` without ``--force``).
EXIT_REFUSED = 1


def main() -> None:
    """Entry point of the ``fenced`` command."""
    if app is None:
        sys.exit("the fenced command needs its extra: pip install 'fenced[cli]'")
    app()


_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str | float) -> float:
    """Seconds from ``90``, ``1.5``, ``30s``, ``5m``, ``1h`` or ``2d`` (a CLI option's value;
    an option's default comes as a number)."""
    if isinstance(text, (int, float)):
        return float(text)
    raw = text.strip().lower()
    unit = raw[-1:] if raw[-1:] in "smhd" else ""
    try:
        value = float(raw[: len(raw) - len(unit)])
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise typer.BadParameter(
            f"{text!r} is not a duration: give seconds or a number with s, m, h or d, "
            "e.g. 90, 30s, 5m, 1h"
        )
    return value * _UNITS[unit]


def _err(line: str) -> None:
    # Messages quote names and holders read from Redis: never a terminal control.
    print(printable(line), file=sys.stderr, flush=True)


def _fail(line: str, code: int = EXIT_USAGE) -> NoReturn:
    """Say why on stderr, and exit with ``code``."""
    _err(line)
    raise SystemExit(code)


@lru_cache(maxsize=8)
def _retry_policy(text: str) -> dict[str, Any]:
    """Client options for $FENCED_REDIS_RETRIES: how many times a command is tried again
    after a connection error or a timeout (0 fails at the first).

    Unset, a command is tried again twice after a refused or dropped connection, within
    about a second, and never after a timeout: each attempt has already waited its whole
    timeout, and redis-py's own policy (10 retries, each waiting again) kept an
    operator's command on a server that does not answer (or a TLS URL at a plain port)
    for about two minutes. ``fenced run`` renews on a schedule of its own, whatever this.
    """
    # Made once per setting: clients are cached by their options, a policy among them.
    from redis.backoff import ExponentialBackoff, NoBackoff, default_backoff
    from redis.exceptions import ConnectionError, TimeoutError
    from redis.retry import Retry

    if not text:
        return {"retry": Retry(ExponentialBackoff(cap=0.5, base=0.1), 2, (ConnectionError,))}
    if not (text.isascii() and text.isdigit()):
        raise ConfigError(
            f"FENCED_REDIS_RETRIES={text!r} is not a number of retries: give a whole "
            "number, 0 for none, or leave it unset for 2 retries of a refused connection"
        )
    retries = int(text)
    if not retries:
        return {"retry": Retry(NoBackoff(), 0)}
    # The policy and the errors it retries on, in the form redis-py's documentation gives.
    return {
        "retry": Retry(default_backoff(), retries),  # type: ignore[no-untyped-call]
        "retry_on_error": [ConnectionError, TimeoutError],
    }


def _client(url: str | None) -> Any:
    """The client of ``--redis``, else $FENCED_REDIS_CLIENT (a factory), else $FENCED_REDIS_URL."""

    try:
        if not url and os.environ.get("FENCED_REDIS_CLIENT"):
            return client_from_setting(
                os.environ["FENCED_REDIS_CLIENT"], setting="FENCED_REDIS_CLIENT"
            )
        url = url or os.environ.get("FENCED_REDIS_URL")
        if not url:
            _fail("fenced: no Redis given: pass --redis URL or set FENCED_REDIS_URL")
        retries = _retry_policy(os.environ.get("FENCED_REDIS_RETRIES", "").strip())
        return connect(url, socket_connect_timeout=5, socket_timeout=10, **retries)
    except (ClaimUnavailable, ConfigError) as exc:
        _fail(f"fenced: {exc}", EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_UNAVAILABLE)


@contextmanager
def _talking_to(client: Any) -> Iterator[None]:
    """Turn an unreachable Redis and bad input into one-line messages and exit codes."""

    try:
        yield
    except UNREACHABLE as exc:
        why = why_unreachable(exc)
        _fail(f"fenced: cannot reach Redis at {describe_client(client)}: {why}", EXIT_UNAVAILABLE)
    except redis.ResponseError as exc:
        # An error reply (a key of the wrong type, a replica, a full server): one line.
        where = describe_client(client)
        _fail(f"fenced: Redis at {where} answered with an error: {exc}", EXIT_UNAVAILABLE)
    except (ClaimUnavailable, ConfigError) as exc:
        _fail(f"fenced: {exc}", EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_UNAVAILABLE)
    except redis.RedisError as exc:
        # The client refusing its own options when it first connects, and the like: one
        # line, never a traceback.
        where = describe_client(client)
        _fail(f"fenced: the Redis client for {where} failed: {type(exc).__name__}: {exc}")


@contextmanager
def _metrics_to(path: str | None) -> Iterator[None]:
    """With ``--metrics-file``: count the run's claim metrics, write them when it ends."""
    if path is None:
        yield
        return

    try:
        from .metrics import Textfile

        recorder = Textfile(path)
    except (ImportError, ConfigError) as exc:  # no prometheus_client; no such directory
        _fail(f"fenced: {exc}")
    recorder.start()
    try:
        yield
    finally:
        recorder.stop()
        try:
            recorder.write()
        except OSError as exc:
            # The command ran (or was skipped) as it would have: its status stands.
            _err(f"fenced: --metrics-file {path!r} was not written: {exc}")


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str), flush=True)


if app is not None:
    from rich.console import Console
    from typer.core import TyperCommand

    class _Command(TyperCommand):
        """A subcommand whose ``--help`` reads as docs/cli.md writes the command: each
        argument as its metavar (``NAME``, ``[NAME]...``, ``-- COMMAND...``), never a
        Python type, every default and range in words; and the whole first line of its
        help in ``fenced --help``. One layout whatever typer and rich are installed."""

        def format_help(self, ctx: Any, formatter: Any) -> None:
            # Click's own layout, which the methods below fill in (typer's rich panels
            # print types and brackets of their own).
            super(TyperCommand, self).format_help(ctx, formatter)

        def collect_usage_pieces(self, ctx: Any) -> list[str]:
            pieces = [self.options_metavar] if self.options_metavar else []
            return pieces + [_metavar(p) for p in _params(self, ctx, "argument")]

        def format_options(self, ctx: Any, formatter: Any) -> None:
            arguments = [(_metavar(p), p.help or "") for p in _params(self, ctx, "argument")]
            options = [_option_row(p) for p in _params(self, ctx, "option")]
            for title, rows in (("Arguments", arguments), ("Options", options)):
                if rows:
                    with formatter.section(title):
                        formatter.write_dl(rows)

        def get_short_help_str(self, limit: int = 45) -> str:
            # The first paragraph whole (click cuts it at `limit`, with "..."): the
            # command list wraps it instead.
            first = (self.short_help or self.help or "").strip().split("\n\n")[0]
            return " ".join(first.split())

    def _params(command: Any, ctx: Any, kind: str) -> list[Any]:
        return [
            p
            for p in command.get_params(ctx)
            if p.param_type_name == kind and not getattr(p, "hidden", False)
        ]

    def _metavar(param: Any) -> str:
        """An argument or an option value as the docs write it (each declares one)."""
        return str(param.metavar or param.name.upper())

    def _option_row(param: Any) -> tuple[str, str]:
        """An option's line of ``--help``: ``-n, --limit N`` and its help, then the
        environment variable, the default and the range, in words."""
        # Short names first, as click lists them: -q, --quiet.
        names = ", ".join(sorted(param.opts, key=lambda o: len(o) - len(o.lstrip("-"))))
        if param.secondary_opts:
            names += " / " + ", ".join(param.secondary_opts)
        if not param.is_flag:
            names += f" {_metavar(param)}"
        extra = []
        if param.envvar and getattr(param, "show_envvar", True):
            extra.append(f"env var: {param.envvar}")
        default = _default_text(param)
        if default:
            extra.append(f"default: {default}")
        low, high = (_bound(param, end) for end in ("min", "max"))
        if low is not None and high is not None:
            extra.append(f"{low} to {high}")
        elif low is not None or high is not None:
            extra.append(f"at least {low}" if low is not None else f"at most {high}")
        if param.required:
            extra.append("required")
        text = param.help or ""
        return names, f"{text}  [{'; '.join(extra)}]" if extra else text

    def _default_text(param: Any) -> str:
        """An option's default as words ("" when there is none to show: a flag, None)."""
        if isinstance(param.show_default, str):
            return param.show_default
        value = param.default
        if param.is_flag or not param.show_default or value in (None, "", [], ()):
            return ""
        if callable(value):
            return ""
        if param.metavar == "DURATION":
            return f"{value:g}s"
        return f"{value:g}" if isinstance(value, float) else str(value)

    def _bound(param: Any, end: str) -> str | None:
        """A number option's min or max (on the option in typer 0.2x, on its type before)."""
        value = getattr(param, end, None)
        if value is None:
            value = getattr(getattr(param, "type", None), end, None)
        return None if value is None else f"{value:g}" if isinstance(value, float) else str(value)

    # What ``fenced run`` does when another holder has the claim ("raise" is a keyword,
    # hence the functional form).
    def _on_busy(value: str) -> str:
        """``--on-busy``: a policy ``fenced run`` accepts (or an alias of one)."""
        if value in ON_BUSY or value in ON_BUSY_ALIASES:
            return value

        guess = closest(value, (*ON_BUSY, *ON_BUSY_ALIASES))
        hint = f"; did you mean {guess}?" if guess else ""
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(ON_BUSY)}{hint}")

    RedisOpt = Annotated[
        str | None,
        typer.Option(
            "--redis", metavar="URL", envvar="FENCED_REDIS_URL", help="Redis of the claims."
        ),
    ]

    def _namespace(value: str) -> str:
        """The rule a Claim applies (fenced._lease.check_namespace), as a usage error."""

        try:
            return check_namespace(value)
        except ConfigError as exc:
            raise typer.BadParameter(exc.message) from None

    NamespaceOpt = Annotated[
        str,
        typer.Option(
            "--namespace", metavar="NS", callback=_namespace, help="Key prefix of the claims."
        ),
    ]
    JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
    WideOpt = Annotated[
        bool,
        typer.Option(
            "--wide",
            help="One table row per record, as wide as it needs (narrower terminals "
            "than 120 columns get a line or two per record; --json has every value).",
        ),
    ]
    NameArg = Annotated[
        str, typer.Argument(metavar="NAME", help="Claim name: the resource two runs collide on.")
    ]

    def _duration(text: str) -> Any:
        """An option given as a DURATION (:func:`parse_duration`)."""
        return typer.Option(metavar="DURATION", parser=parse_duration, help=text)

    def _claim_flags(*names: str) -> Callable[[Any], Any]:
        """The command takes these ClaimOptions as flags, typed, explained and defaulted
        by the struct itself, and gets them as ``claim`` (a dict, None left out)."""
        import inspect
        import re
        import typing

        hints = typing.get_type_hints(ClaimOptions)
        # As the other commands and docs/cli.md spell them (TEXT otherwise).
        metavars = {"namespace": "NS"}

        # The help as this command spells the options: replica_timeout is --replica-timeout.
        spelled = re.compile(r"\b(" + "|".join(n for n in HELP if "_" in n) + r")\b")

        def flag(name: str) -> inspect.Parameter:
            kind = next(t for t in typing.get_args(hints[name]) or (hints[name],) if t is not None)
            default = getattr(DEFAULT, name)
            text = spelled.sub(lambda m: "--" + m[1].replace("_", "-"), HELP[name])
            # "None: no limit" is for Python callers; here None is the default, unsaid.
            text = re.sub(r"; None: [^;)]*", "", text) if default is not None else text
            text = text.replace("None: ", "default: ")
            text = text[0].upper() + text[1:] + "."
            if kind is float:  # seconds, given as 30s, 10m, 2h or a number
                option = _duration(text)
            elif kind is bool:  # a switch: --rate-spread
                option = typer.Option(f"--{name.replace('_', '-')}", help=text)
            else:
                metavar = "N" if kind is int else metavars.get(name, "TEXT")
                option = typer.Option(metavar=metavar, help=text)
            return inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=default,
                annotation=Annotated[hints[name], option],
            )

        def wrap(command: Any) -> Any:
            own = inspect.signature(command, eval_str=True)
            params = [p for p in own.parameters.values() if p.name != "claim"]
            params += [flag(name) for name in names]

            @wraps(command)
            def with_flags(**given: Any) -> Any:
                claim = {n: given.pop(n) for n in names}
                return command(claim={n: v for n, v in claim.items() if v is not None}, **given)

            with_flags.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
            with_flags.__annotations__ = {p.name: p.annotation for p in params}
            return with_flags

        return wrap

    def _print_version(value: bool) -> None:
        if value:
            print(__version__)
            raise typer.Exit()

    @app.callback()
    def _fenced(
        show_version: Annotated[
            bool,
            typer.Option(
                "--version",
                callback=_print_version,
                is_eager=True,
                help="Print the version and exit.",
            ),
        ] = False,
    ) -> None:
        """Exclusive Redis claims for cron commands and Celery tasks: run, list, release, check."""

    @app.command(cls=_Command)
    def demo(
        feeds: Annotated[
            bool, typer.Option("--feeds", help="Run the feed importer example instead.")
        ] = False,
        walkthrough: Annotated[
            bool, typer.Option("--walkthrough", help="Only the short single-process tour.")
        ] = False,
        web: Annotated[
            bool,
            typer.Option(
                "--web",
                help="After the acts, keep the embedded Redis up and serve fenced web on "
                "it (127.0.0.1, --web-port) until Ctrl-C.",
            ),
        ] = False,
        web_port: Annotated[
            int,
            typer.Option(metavar="PORT", min=1, max=65535, help="Port of fenced web with --web."),
        ] = 8377,
        keep: Annotated[
            bool,
            typer.Option(
                "--keep",
                envvar="FENCED_DEMO_KEEP",
                help="Keep the acts' output (tiles, pointers, the workers' logs) in its "
                "fenced-demo-* directory in the temporary folder, and say where; by "
                "default it is removed when the demo ends.",
            ),
        ] = False,
    ) -> None:
        """Run the map rebuild scenarios on an embedded Redis with real Celery workers.

        Exit status 0 only if every act's expectation held.
        """
        if walkthrough:
            from .demo.walkthrough import run

            raise typer.Exit(run())
        if feeds:
            from .demo.feeds import main as feeds_main

            raise typer.Exit(feeds_main())
        from .demo.runner import main as demo_main

        if not web:
            raise typer.Exit(demo_main(keep=keep))
        try:
            from .web.app import listen
        except ImportError:
            _fail("fenced demo --web needs the web extra: pip install 'fenced[web]'")

        try:  # before the acts: a port in use is said now, not minutes later
            sock = listen("127.0.0.1", web_port, option="--web-port")
        except ConfigError as exc:
            _fail(f"fenced demo: {exc.message}")
        raise typer.Exit(demo_main(web_port=web_port, web_socket=sock, keep=keep))

    @app.command(cls=_Command)
    def doctor(
        redis_url: Annotated[
            str | None,
            typer.Option(
                "--redis",
                metavar="URL",
                help="Redis to check. Default: the lock store of --app (fenced_redis_url, "
                "then $FENCED_REDIS_URL, as its workers resolve it); without --app, "
                "$FENCED_REDIS_URL.",
            ),
        ] = None,
        celery_app: Annotated[
            str | None,
            typer.Option(
                "--app", metavar="APP", help="Celery app to check, named as for celery -A."
            ),
        ] = None,
        store_url: Annotated[
            str | None,
            typer.Option(
                "--store",
                metavar="URL",
                help="Object store to probe for the conditional writes fenced publishes "
                "with (s3://bucket/prefix, gs://..., az://...; credentials and endpoint "
                "from AWS_*, GOOGLE_*, AZURE_*). Needs fenced[objstore].",
            ),
        ] = None,
        namespace: NamespaceOpt = "fenced",
        as_json: JsonOpt = False,
    ) -> None:
        """Check the lock Redis, a Celery app and claim naming for what breaks claims.

        With --app and no --redis, the Redis checked is the one the app's claims use:
        the fenced_redis_url setting, then FENCED_REDIS_URL; never the broker. An app
        with neither gets an error finding that says so.

        \b
        Exit status:
          0   no errors (warnings and notes may be shown)
          1   at least one error
          2   usage: nothing to check, the app cannot be imported, or a bad Redis URL
        """
        from .doctor import lock_store_url, render, run_doctor

        app_obj = _load_app(celery_app) if celery_app else None
        client = None
        if redis_url:
            client = _client(redis_url)
        elif app_obj is not None:
            if lock_store_url(app_obj) is not None or app_obj.conf.get("fenced_redis_client"):
                from .celery import lock_redis

                # The client its workers make (fenced_redis_options included), so the
                # doctor connects as they do.
                try:
                    client = lock_redis(app_obj)
                except ValueError as exc:
                    _fail(
                        "fenced doctor: bad lock store (from fenced_redis_client, "
                        f"fenced_redis_url or FENCED_REDIS_URL): {exc}"
                    )
        elif os.environ.get("FENCED_REDIS_URL") or os.environ.get("FENCED_REDIS_CLIENT"):
            client = _client(None)
        elif store_url is None:
            _fail("fenced doctor: nothing to check: pass --redis URL, --app APP or --store URL")
        report = run_doctor(client, app_obj, namespace=namespace, store=store_url)
        if as_json:
            print(report.as_json(), flush=True)
        else:
            render(report, Console())
        raise typer.Exit(report.exit_code)

    def _load_app(spec: str) -> Any:
        """A Celery app found as ``celery -A`` finds it, with its task modules imported.

        ``module``, ``module:attr``, ``module.attr``, a module's ``app`` or ``celery``
        attribute, or a package's ``celery`` submodule (Celery's own ``find_app``, with
        the current directory first); then the modules a worker imports at start
        (``imports``, ``include`` and ``autodiscover_tasks()``, Django apps included),
        so the doctor sees the tasks the workers run.
        """
        from celery import Celery
        from celery.app.utils import find_app

        # The project's own packages (autodiscovered task modules too) come from here.
        sys.path.insert(0, os.getcwd())
        module, _, attr = spec.partition(":")
        try:
            if attr:  # find_app names the whole spec when only the attribute is missing
                found = getattr(importlib.import_module(module), attr, None)
                if found is None:
                    _fail(
                        f"fenced doctor: module {module!r} has no attribute {attr!r} (--app "
                        f"{spec}); name the app, e.g. --app {module}:app"
                    )
            found = find_app(spec)
        except ModuleNotFoundError as exc:
            _fail(f"fenced doctor: cannot import {exc.name!r} (--app {spec}): {exc}; check --app")
        except AttributeError as exc:
            _fail(
                f"fenced doctor: {spec!r} names no Celery app ({exc}); use --app module, "
                "module:attribute or package (with a celery submodule), as for celery -A"
            )
        except Exception as exc:
            _fail(f"fenced doctor: importing --app {spec} failed: {type(exc).__name__}: {exc}")
        if not isinstance(found, Celery):
            _fail(
                f"fenced doctor: --app {spec} is a {type(found).__name__}, not a Celery app; "
                "name the app itself, e.g. --app proj.celery:app"
            )
        try:
            # What a worker does at start: the import_modules signal runs the lazy
            # autodiscover_tasks() (and the Django fixup's setup) before the modules load.
            found.loader.import_default_modules()
        except Exception as exc:
            _fail(
                f"fenced doctor: importing the task modules of --app {spec} failed: "
                f"{type(exc).__name__}: {exc}"
            )
        return found

    @app.command(cls=_Command)
    def version() -> None:
        """Print the version."""
        _print_version(True)

    try:  # typer 0.2x parses with a click of its own: its exceptions are that click's
        from typer._click.exceptions import NoSuchOption, UsageError
    except ImportError:  # pragma: no cover - older typer, on click itself
        from click.exceptions import NoSuchOption, UsageError  # type: ignore[assignment]

    class _RunCommand(_Command):
        """``fenced run``: the mistakes of where ``--`` goes get a usage error that says so."""

        def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
            if "--" in args:
                before = args[: args.index("--")]
                try:
                    # Arguments are parsed into the values by name, as options are.
                    values, _rest, _order = self.make_parser(ctx).parse_args(list(before))
                    named = isinstance(values.get("name"), str)
                except UsageError:
                    named = True  # the full parse below names the mistake
                if not named and "--help" not in before:
                    raise UsageError(
                        "a claim name is needed before '--': fenced run NAME -- CMD [ARGS]...",
                        ctx,
                    )
            try:
                return super().parse_args(ctx, args)
            except NoSuchOption as exc:
                if "--" not in args:
                    # `fenced run NAME ls -la`: the command's options were read as ours.
                    exc.message += (
                        f"; if {exc.option_name} belongs to the command, put '--' before "
                        "the command: fenced run NAME -- CMD [ARGS]..."
                    )
                raise

    @app.command(
        "run",
        cls=_RunCommand,
        epilog="Example (crontab): */5 * * * * fenced run --redis redis://locks:6379/1 "
        "--quiet backup:db -- /opt/backup.sh",
    )
    @_claim_flags(*RUN_CLAIM_OPTIONS)
    def run_cmd(
        name: NameArg,
        command: Annotated[
            list[str] | None,
            typer.Argument(
                metavar="-- COMMAND...", help="The command and its arguments, after '--'."
            ),
        ] = None,
        redis_url: RedisOpt = None,
        on_busy: Annotated[
            str,
            typer.Option(
                metavar="|".join(ON_BUSY),
                callback=_on_busy,
                help="When another holder has the claim: skip it (exit 0), wait for it, "
                "raise (exit 75; 'fail' is another name for raise), or replace it (the "
                "holder's command is ended as lost).",
            ),
        ] = "skip",
        wait_timeout: Annotated[
            float | None,
            _duration("With --on-busy wait: give up after this long (90s, 5m, or seconds)."),
        ] = None,
        grace: Annotated[
            float, _duration("Claim lost: SIGKILL this long after SIGTERM (10s, or seconds).")
        ] = 10.0,
        quiet: Annotated[
            bool, typer.Option("--quiet", "-q", help="Print nothing on a skip.")
        ] = False,
        as_json: Annotated[
            bool,
            typer.Option(
                "--json",
                help="At the end, one JSON line on stdout: name, ran, outcome, reason, exit, "
                "fence, holder, label.",
            ),
        ] = False,
        record_command: Annotated[
            bool,
            typer.Option(
                "--record-command",
                help="Keep the whole command line in the run record (default: the program "
                "and a digest of the line; arguments may hold passwords).",
            ),
        ] = False,
        pass_fenced_env: Annotated[
            bool,
            typer.Option(
                "--pass-fenced-env",
                help="Give the command FENCED_REDIS_URL, FENCED_REDIS_CLIENT and "
                "FENCED_SECRET_KEY (default: removed from its environment).",
            ),
        ] = False,
        metrics_file: Annotated[
            str | None,
            typer.Option(
                metavar="PATH",
                help="When the run ends (a skip too), write its claim metrics to PATH in "
                "Prometheus text format, atomically, for node_exporter's textfile collector "
                "(name it *.prom). Needs pip install 'fenced[metrics]'.",
            ),
        ] = None,
        claim: dict[str, Any] | None = None,
    ) -> None:
        """Run a command while holding a claim: a distributed flock for cron.

        The command runs in its own process group while the claim is renewed.
        Signals sent to fenced run are forwarded: TERM, INT, HUP and QUIT to the
        command's group, USR1 and USR2 to the command alone. A skip prints one
        line naming the holder (nothing with --quiet). A DURATION is 30s, 10m,
        2h, 2d or seconds.

        \b
        Exit status:
          CMD's  the command's own status; killed by signal N: 128+N
          0      busy with --on-busy skip (the default)
          75     busy with --on-busy raise, or waited past --wait-timeout
          0/75   ran recently (--cooldown): as busy; a window is never waited out
          76     claim lost while the command ran: SIGTERM, then SIGKILL
          69     Redis unreachable: the command was not started
          2      usage: no --redis and no FENCED_REDIS_URL, bad option
          126    command not executable; 127 command not found
        """

        client = _client(redis_url)
        opts = RunOptions(
            name=name,
            argv=list(command or []),
            claim=claim or {},
            on_busy=on_busy,
            wait_timeout=wait_timeout,
            grace=grace,
            quiet=quiet,
            record_command=record_command,
            pass_fenced_env=pass_fenced_env,
        )
        on_result = (lambda result: print(json.dumps(result), flush=True)) if as_json else None
        with _talking_to(client), _metrics_to(metrics_file):
            code = run_command(client, opts, on_result=on_result)
        raise typer.Exit(code)

    @app.command("ls", cls=_Command)
    def ls_cmd(
        redis_url: RedisOpt = None,
        namespace: NamespaceOpt = "fenced",
        as_json: JsonOpt = False,
        watch: Annotated[bool, typer.Option("--watch", "-w", help="Redraw until Ctrl-C.")] = False,
        interval: Annotated[
            float, typer.Option(metavar="S", min=0.1, help="Seconds between draws with --watch.")
        ] = 1.0,
        wide: WideOpt = False,
    ) -> None:
        """List every held claim: holder, token, age, time left, fence, skips, last outcome.

        A name in its cooldown window (a run ended ok within --cooldown) is listed
        too, with the time left of its window; so is a name marked at enqueue, one
        whose rate holds its next start back, and one with a pending debounce burst.
        """

        from rich.live import Live
        from rich.text import Text

        client = _client(redis_url)
        console = _console(wide)
        if not watch:
            with _talking_to(client):
                infos = list_claims(client, namespace)
            if as_json:
                _print_json([i.as_dict() for i in infos])
            else:
                console.print(_ls_view(infos, namespace, console))
            return

        def view() -> Any:
            try:
                infos = list_claims(client, namespace)
            except UNREACHABLE as exc:
                # Watching outlives a Redis restart: say so and look again.
                return Text(f"cannot reach Redis: {why_unreachable(exc)}", style="red")
            return [i.as_dict() for i in infos] if as_json else _ls_view(infos, namespace, console)

        with suppress(KeyboardInterrupt):
            if as_json:
                while True:  # one JSON document per line and draw
                    print(json.dumps(view(), default=str), flush=True)
                    time.sleep(interval)
            with Live(view(), console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(view(), refresh=True)

    def _console(wide: bool = False) -> Console:
        from ._views import WIDE

        # Names, commands and reasons are data: never read them as markup or emoji codes.
        plain = partial(Console, markup=False, emoji=False, highlight=False)
        console = plain()
        if not console.is_terminal and "COLUMNS" not in os.environ:
            # Piped: a line per row, as long as its values, never a value cut in two
            # (an explicit COLUMNS still rules).
            return plain(width=PIPED_WIDTH)
        return plain(width=2 * WIDE) if wide and console.width < WIDE else console

    def _ls_view(infos: list[Any], namespace: str, console: Console) -> Any:
        from rich.text import Text

        from ._views import WIDE, claims_list, claims_table

        if not infos:
            return Text(f"no claims held in namespace {namespace!r}")
        held = sum(1 for i in infos if i.holder is not None)
        cooled = sum(1 for i in infos if i.holder is None and i.cooldown_left is not None)
        title = f"{held} held in namespace {namespace!r}"
        if cooled:
            title += f", {cooled} in a cooldown window"
        if len(infos) > held + cooled:
            title += f", {len(infos) - held - cooled} not held (queued, rate limited or debounced)"
        return claims_table(infos, title) if console.width >= WIDE else claims_list(infos, title)

    @app.command("show", cls=_Command)
    def show_cmd(
        name: NameArg,
        limit: Annotated[
            int, typer.Option("--limit", "-n", metavar="N", min=1, help="Runs to show.")
        ] = 20,
        redis_url: RedisOpt = None,
        namespace: NamespaceOpt = "fenced",
        as_json: JsonOpt = False,
        wide: WideOpt = False,
    ) -> None:
        """Show a claim's holder and its run records, newest first."""
        from ._views import WIDE, report_list, report_table

        client = _client(redis_url)
        with _talking_to(client):
            report = show_claim(client, name, namespace=namespace, limit=limit)
        if as_json:
            _print_json(report.as_dict())
            return
        console = _console(wide)
        console.print(report_table(report) if console.width >= WIDE else report_list(report))
        if report.beat is not None:
            # Its runs are ticks, not records: what the beat did is its status.
            beat = printable(report.beat.name)
            console.print(f"the leader claim of a beat: fenced beat {beat} shows it alone")
            for line in _beat.lines(report.beat):
                console.print(line, soft_wrap=True)  # a line per entry, as fenced beat
        elif all(run.outcome == "skipped" for run in report.runs):
            # Skips are recorded whatever the claim's options; runs only where asked.
            only = " (only skips)" if report.runs else ""
            console.print(
                f"no run recorded{only}: this name's runs are not recorded. fenced run and "
                "ClaimedTask record every run; @exclusive and Claim with records=True"
            )

    @app.command("beat", cls=_Command)
    def beat_cmd(
        name: Annotated[
            str,
            typer.Argument(metavar="NAME", help="The beat's fenced_beat_name (its app's name)."),
        ],
        redis_url: RedisOpt = None,
        namespace: NamespaceOpt = "fenced",
        as_json: JsonOpt = False,
    ) -> None:
        """Show who leads a beat (fenced.celery.beat), its fence, and each entry's last
        tick and next one."""
        client = _client(redis_url)
        with _talking_to(client):
            report = beat_status(client, name, namespace=namespace)
        if as_json:
            _print_json(_beat.as_dict(report))
            return
        for line in _beat.lines(report):
            print(line)

    @app.command("web", cls=_Command)
    def web_cmd(
        redis_url: RedisOpt = None,
        namespace: NamespaceOpt = "fenced",
        host: Annotated[
            str, typer.Option(metavar="ADDR", help="Address to listen on (loopback by default).")
        ] = "127.0.0.1",
        port: Annotated[
            int,
            typer.Option(
                metavar="PORT",
                min=0,
                max=65535,
                help="Port to listen on (0: one the system chooses, printed at start).",
            ),
        ] = 8377,
        allow_release: Annotated[
            bool,
            typer.Option(
                "--allow-release",
                help="Let the page (and POST /api/claims/NAME/release) clear claims, with "
                "the token as 'Authorization: Bearer TOKEN'.",
            ),
        ] = False,
        token_file: Annotated[
            str | None,
            typer.Option(
                metavar="F",
                help="With --allow-release: the token, read from this file (else "
                "$FENCED_WEB_TOKEN, else one is made and printed once).",
            ),
        ] = None,
        allow_host: Annotated[
            list[str] | None,
            typer.Option(
                metavar="NAME",
                help="A Host name the page may be opened by (repeat for more); beside the "
                "loopback names, and --host's address when it is one.",
            ),
        ] = None,
        refresh: Annotated[
            float, typer.Option(metavar="S", min=0.2, help="Seconds between page refreshes.")
        ] = 2.0,
        alert_after_skips: Annotated[
            int,
            typer.Option(
                metavar="N",
                min=0,
                help="Highlight claims with N or more consecutive skips (0: never); the "
                "default is Celery's claim_alert_after_skips default.",
            ),
        ] = 5,
        forwarded_allow_ips: Annotated[
            str | None,
            typer.Option(
                metavar="ADDRS",
                help="Believe X-Forwarded-For (the client address a release is recorded "
                "for) from these proxy addresses, comma-separated; default: from none.",
            ),
        ] = None,
        ctx: typer.Context = None,  # type: ignore[assignment]
    ) -> None:
        """Serve a dashboard of the held claims and their runs, and its JSON API.

        Needs the web extra: pip install 'fenced[web]'. Listens on 127.0.0.1
        unless --host says otherwise; releasing from the page needs
        --allow-release and the token.

        \b
        Exit status:
          0   stopped with Ctrl-C or SIGTERM
          2   usage: no --redis, the web extra missing, an unreadable --token-file,
              a port in use
          69  Redis unreachable at start
        """
        try:
            from .web import create_app
            from .web.app import listen, serve
        except ImportError:
            _fail("fenced web needs its extra: pip install 'fenced[web]'")

        client = _client(redis_url)
        label = redact(redis_url) if redis_url else describe_client(client)
        if redis_url and _given_on_command_line(ctx, "redis_url") and _has_password(redis_url):
            _err(
                "fenced web: WARNING: the --redis URL holds a password, which other users "
                "see in ps for as long as the server runs: set FENCED_REDIS_URL instead"
            )
        with _talking_to(client):
            client.ping()
        token = _web_token(token_file) if allow_release else None
        if allow_release and not _loopback(host):
            _err(
                f"fenced web: WARNING: --allow-release on {host}, not a loopback address: "
                "anyone who can reach this port and has the token can clear claims, and "
                "the token crosses the network in clear text unless a TLS proxy is in "
                "front; prefer --host 127.0.0.1 behind such a proxy"
            )

        echo_to_stderr()  # the fenced.audit line of each release from the page
        try:
            web = create_app(
                client,
                namespace=namespace,
                allow_release=allow_release,
                token=token,
                refresh=refresh,
                alert_after_skips=alert_after_skips,
                redis_label=label,
                allowed_hosts=_host_names(host, allow_host or []),
            )
            sock = listen(host, port)
        except ConfigError as exc:
            _fail(f"fenced web: {exc.message}")
        port = sock.getsockname()[1]  # --port 0: the one the system chose
        shown = f"[{host.strip('[]')}]" if ":" in host else host
        serving = (
            f"fenced web: http://{shown}:{port}/ shows the claims of namespace "
            f"{namespace!r} on {label}{'; release allowed' if allow_release else ''} "
            "(Ctrl-C stops)"
        )
        serve(web, sock, lambda: _err(serving), forwarded_allow_ips=forwarded_allow_ips)

    def _has_password(url: str) -> bool:

        parsed = parse_url(url)  # a bad URL was refused before this
        return bool(parsed.password or parsed.options.get("sentinel_password"))

    def _given_on_command_line(ctx: Any, param: str) -> bool:
        """Whether an option's value came from the command line (not its envvar)."""
        try:
            return bool(ctx.get_parameter_source(param).name == "COMMANDLINE")
        except Exception:  # no context: say it did, to warn rather than not
            return True

    def _host_names(host: str, given: list[str]) -> list[str] | None:
        """The Host names the server answers to (None: any), so that a page elsewhere
        that rebinds its DNS to this machine is refused; warns when that is any."""
        address = host.strip("[]")
        names = set(given)
        wildcard = getattr(_ip(host), "is_unspecified", False)
        if wildcard or _loopback(host):  # 0.0.0.0 and :: listen on loopback too
            names |= {"127.0.0.1", "localhost", "::1"}
        if not wildcard:
            names.add(address)
        elif not given:
            _err(
                f"fenced web: WARNING: on {host} it answers to any Host name, so a web page "
                "whose DNS is rebound to this machine could read the claims: pass "
                "--allow-host NAME for each name the page is opened by"
            )
            return None
        return sorted(names)

    def _loopback(host: str) -> bool:
        return host == "localhost" or getattr(_ip(host), "is_loopback", False)

    def _ip(host: str) -> Any:
        """The IP address ``host`` is (in brackets or not); None for a host name."""
        import ipaddress

        try:
            return ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return None

    def _web_token(token_file: str | None) -> str:
        """The release token: --token-file, else $FENCED_WEB_TOKEN, else a new one, printed."""
        if token_file:
            try:
                with open(token_file, encoding="utf-8") as f:
                    token = f.read().strip()
            except (OSError, UnicodeDecodeError) as exc:
                _fail(f"fenced web: cannot read --token-file {token_file}: {exc}")
            if not token:
                _fail(f"fenced web: --token-file {token_file} is empty: put the token in it")
            mode = os.stat(token_file).st_mode & 0o777
            if mode & 0o077:
                _err(
                    f"fenced web: WARNING: --token-file {token_file} is open to other "
                    f"users (mode {mode:o}): chmod 600 {token_file}"
                )
            return token
        token = os.environ.get("FENCED_WEB_TOKEN", "").strip()
        if token:
            return token
        if not sys.stderr.isatty():
            # A made token goes to a terminal only: a log or a journal would keep it.
            _fail(
                "fenced web: --allow-release needs a token: pass --token-file F (mode 600) "
                "or set FENCED_WEB_TOKEN; one is made for you only when stderr is a terminal"
            )
        import secrets

        token = secrets.token_urlsafe(24)
        # Printed once, to the terminal that started the server: nowhere else keeps it.
        _err(f"fenced web: release token (shown once, pass --token-file F to choose): {token}")
        return token

    @app.command("release", cls=_Command)
    def release_cmd(
        name: NameArg,
        force: Annotated[
            bool, typer.Option("--force", help="Required: clear a live claim.")
        ] = False,
        reason: Annotated[
            str | None, typer.Option(metavar="TEXT", help="Why; kept in the run records.")
        ] = None,
        token: Annotated[
            str,
            typer.Option(
                metavar="PREFIX",
                help="Only if the holder's token starts so (the token fenced ls shows); "
                "with several holders (--limit), the one to clear.",
            ),
        ] = "",
        every: Annotated[
            bool,
            typer.Option("--all", help="With several holders (--limit): clear every one."),
        ] = False,
        redis_url: RedisOpt = None,
        namespace: NamespaceOpt = "fenced",
        as_json: JsonOpt = False,
    ) -> None:
        """Clear a stale claim by hand, recording who did it and why.

        A claim whose holder died is freed by its ttl anyway: use this when the
        ttl is long and the holder is known to be gone. Clearing a live claim
        lets a second run start beside the first. Without --token it clears
        whoever holds the name when it runs, which may be a run that started
        after the one you checked: --token PREFIX (as fenced ls shows it) clears
        that holder only. A name held by several at once (--limit) needs --token
        PREFIX for the one to clear, or --all.

        \b
        Exit status:
          0   released, or nothing was held
          1   refused: no --force, --token names another holder, or several hold
              the name and neither --token nor --all says which
          2   usage: no --reason, no --redis
          69  Redis unreachable
        """
        client = _client(redis_url)
        if not force:
            from ._views import token_text

            held = aim = ""
            try:
                holder = read_holder(client, name, namespace=namespace)
                held = f" (held by {holder})" if holder else " (nothing is held under it)"
                if holder and token_text(holder):
                    # Named, the holder checked is the only one the release clears.
                    aim = f" --token {token_text(holder)}"
            except Exception:
                pass  # the refusal stands on its own; Redis is only asked to say more
            _fail(
                f"fenced: refusing to release {name!r} without --force{held}; check that "
                f"its holder is gone (fenced ls), then add --force --reason TEXT{aim}",
                EXIT_REFUSED,
            )
        if not reason or not reason.strip():
            _fail("fenced: add --reason TEXT: the run records keep why a claim was cleared")
        # Earlier versions printed the prefix with an ellipsis: take that text back too.
        prefix = token.strip().rstrip("…")
        if token and not prefix:
            # "" means any holder: a --token that says nothing must not come to mean that.
            _fail(
                f"fenced: --token {token!r} names no prefix; give the token fenced ls --json prints"
            )
        token = prefix
        by = operator()
        echo_to_stderr()  # the fenced.audit line of the act, with no logging set up here
        with _talking_to(client):
            slots = read_slots(client, name, namespace=namespace)
            if len(slots) > 1 and not token and not every:
                held = "; ".join(f"slot {i}: {short_token(h.token)} {h}" for i, h in slots)
                _fail(
                    f"fenced: {name!r} has {len(slots)} holders ({held}); name the one to clear "
                    "with --token PREFIX, or clear every one with --all",
                    EXIT_REFUSED,
                )
            targets = [i for i, _h in slots] if every else [release_slot(slots, token)]
            release = partial(force_release, client, name, reason=reason, namespace=namespace)
            found = [release(by=by, token_prefix="" if every else token, slot=i) for i in targets]
            cleared = [h for h in found if h is not None]
            holder = cleared[0] if cleared else None
            current = None
            if holder is None and token:
                current = read_holder(client, name, namespace=namespace)
                current = current or (slots[0][1] if slots else None)
        # Refused: the holder named is the one that stays.
        shown = holder or current
        result = {
            "name": name,
            "released": holder is not None,
            "holder": shown.as_dict() if shown else None,
            "holders": [h.as_dict() for h in cleared],
            "by": by,
            "reason": reason,
        }
        if current is not None:
            msg = f"fenced: {name!r} is held by another token ({current}); not released"
        elif holder is None:
            msg = f"fenced: nothing held under {name!r} in namespace {namespace!r}"
        else:
            was = "; ".join(str(h) for h in cleared)
            msg = f"fenced: released {name!r}, was held by {was}; recorded by {by}: {reason}"
        if as_json:
            _print_json(result)
        else:
            print(printable(msg), flush=True)
        if current is not None:
            if as_json:
                _err(msg)
            raise typer.Exit(EXIT_REFUSED)

    @app.command("unqueue", cls=_Command)
    def unqueue_cmd(
        names: Annotated[
            list[str] | None,
            typer.Argument(metavar="[NAME]...", help="Claim names whose markers to clear."),
        ] = None,
        every: Annotated[
            bool, typer.Option("--all", help="Clear every enqueue marker of the namespace.")
        ] = False,
        reason: Annotated[
            str | None, typer.Option(metavar="TEXT", help="Why; kept in the audit line.")
        ] = None,
        redis_url: RedisOpt = None,
        namespace: NamespaceOpt = "fenced",
        as_json: JsonOpt = False,
    ) -> None:
        """Clear enqueue markers (claim_enqueue): the next call of each name publishes.

        A marker holds a name from apply_async until its message's run starts or
        ends; a message that will never run (celery purge, a revoked task, a lost
        broker) keeps its name blocked until claim_enqueue_ttl. fenced ls lists
        marked names. A message still queued runs as before: clearing its marker
        lets a second one be sent, and the claim skips one of them if they meet.

        \b
        Exit status:
          0   cleared, or nothing was marked
          1   a marker key holds another type (left alone; the others are cleared)
          2   usage: neither NAME nor --all, or both
          69  Redis unreachable
        """

        if bool(names) == every:
            _fail(
                "fenced: name the markers to clear (fenced unqueue NAME...) or clear every "
                "one with --all, not both"
                if every
                else "fenced: give the names whose markers to clear, or --all for every one"
            )
        client = _client(redis_url)
        by = operator()
        echo_to_stderr()
        results: list[dict[str, Any]] = []
        with _talking_to(client):
            for name in list_queued(client, namespace) if every else list(names or []):
                try:
                    task_id = clear_queued(client, name, namespace=namespace, by=by, reason=reason)
                except ConfigError as exc:  # a key of another type: the others go on
                    results.append({"name": name, "task_id": None, "error": str(exc)})
                else:
                    results.append({"name": name, "task_id": task_id})
        errors = [r["error"] for r in results if "error" in r]
        for error in errors:
            _err(f"fenced: {error}")
        if as_json:
            _print_json(results)
        elif not results:
            print(f"fenced: no enqueue markers in namespace {namespace!r}", flush=True)
        else:
            for result in (r for r in results if "error" not in r):
                if result["task_id"] is None:
                    line = f"fenced: {result['name']!r} had no enqueue marker"
                else:
                    line = (
                        f"fenced: cleared the enqueue marker of {result['name']!r} (task "
                        f"{result['task_id']}): its next call publishes"
                    )
                print(printable(line), flush=True)
        if errors:
            raise typer.Exit(EXIT_REFUSED)


if __name__ == "__main__":
    main()
