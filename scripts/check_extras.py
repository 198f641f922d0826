"""Each extra of the built wheel, installed alone in a fresh virtual environment, does
what the README says it is for: what `make dist` runs after the wheel is built.

A development environment hides a missing dependency (the dev tools pull in half of
PyPI), so each extra gets an environment of its own, with the wheel and that extra only,
and is tried outside the checkout: the `celery` extra runs the quick start as a user
who copied ``examples/quickstart/app.py`` into a project of their own (a worker on a
Redis broker, the task sent twice, one skip).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fenced.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart" / "app.py"


def run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    """Run a command of the fresh environment; its output, or exit naming what failed."""
    done = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise SystemExit(
            f"check_extras: {' '.join(argv)} exited {done.returncode}\n{done.stdout}{done.stderr}"
        )
    return done.stdout + done.stderr


def expect(text: str, *wanted: str, what: str) -> None:
    missing = [w for w in wanted if w not in text]
    if missing:
        raise SystemExit(f"check_extras: {what}: {missing} not in its output:\n{text[-3000:]}")


def quickstart(bin_: Path, home: Path, env: dict[str, str]) -> None:
    """The README's quick start with only `fenced[celery]`: a worker on a Redis broker."""
    shutil.copy(QUICKSTART, home / "app.py")
    log = home / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [str(bin_ / "celery"), "-A", "app", "worker", "-c", "2", "--loglevel", "INFO"],
            cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while " ready." not in log.read_text(errors="replace"):
            if worker.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"check_extras: the worker did not start:\n{log.read_text()}")
            time.sleep(0.2)
        sent = run([str(bin_ / "python"), "app.py"], home, env, timeout=60)
        expect(sent, "'status': 'skipped'", "already running", what="python app.py")
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have died on its own
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


def checks(url: str) -> dict[str, Callable[[Path, Path, dict[str, str]], None]]:
    """For each extra: what it is for, tried in its own environment."""

    def python(code: str, *wanted: str) -> Callable[[Path, Path, dict[str, str]], None]:
        def check(bin_: Path, home: Path, env: dict[str, str]) -> None:
            expect(run([str(bin_ / "python"), "-c", code], home, env), *wanted, what=code)

        return check

    def cli(bin_: Path, home: Path, env: dict[str, str]) -> None:
        run([str(bin_ / "fenced"), "run", "--redis", url, "job:x", "--", "true"], home, env)
        expect(run([str(bin_ / "fenced"), "show", "job:x", "--redis", url], home, env), "ok",
               what="fenced show")  # fmt: skip

    def demo(bin_: Path, home: Path, env: dict[str, str]) -> None:
        run([str(bin_ / "fenced"), "demo", "--walkthrough"], home, env)
        # The object-storage act with what the extra brings: obstore, and no moto, so the
        # act says it has no S3 server and plays its story in memory.
        code = (
            "import sys\nfrom fenced.demo import runner\n"
            "sys.exit(runner.Demo(print).run(['act_objects']))"
        )
        said = run([str(bin_ / "python"), "-c", code], home, env)
        expect(said, "no S3 server here (moto is not installed", "every expectation held",
               what="fenced demo's object-storage act")  # fmt: skip

    return {
        "": python(
            f"import redis, fenced\nwith fenced.Claim(redis.Redis.from_url({url!r}), 'x', ttl=5)"
            " as c: print('fence', c.fence)",
            "fence",
        ),
        "celery": quickstart,
        "cli": cli,
        "web": python("import fenced.web.app; print('web ok')", "web ok"),
        "metrics": python("import fenced.metrics; print('metrics ok')", "metrics ok"),
        "sql": python("from fenced.store import upsert; print('sql ok')", "sql ok"),
        # An in-memory store honours conditional writes: the probe passes, the swap lands.
        "objstore": python(
            "from fenced.store import ObjectPointer, ObjectStore\n"
            "store = ObjectStore('memory:///')\n"
            "pointer = ObjectPointer(store, 'latest')\n"
            "pointer.swap(store.put(b'tile'), fence=1)\n"
            "print('objstore', pointer.read().fence, store.read_bytes(pointer.read().digest))",
            "objstore 1 b'tile'",
        ),
        "hiredis": python("import redis.utils; print(redis.utils.HIREDIS_AVAILABLE)", "True"),
        "demo": demo,
    }


def main(folder: str) -> int:
    (wheel,) = sorted(Path(folder).resolve().glob("*.whl"))
    with RedisServer() as server, tempfile.TemporaryDirectory(prefix="fenced-extras-") as tmp:
        base = server.url.rsplit("/", 1)[0]
        for extra, check in checks(f"{base}/1").items():
            started = time.monotonic()
            home = Path(tmp) / (extra or "core")
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", home], check=True)
            spec = f"{wheel}[{extra}]" if extra else str(wheel)
            pip = [sys.executable, "-m", "pip", "--python", str(home / "bin" / "python")]
            run([*pip, "install", "--quiet", "--disable-pip-version-check", spec], ROOT,
                dict(os.environ), timeout=600)  # fmt: skip
            env = {
                "PATH": f"{home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
                "HOME": os.environ.get("HOME", str(home)),
                "TMPDIR": tmp,
                "CELERY_BROKER_URL": f"{base}/0",
                "FENCED_REDIS_URL": f"{base}/1",
            }
            check(home / "bin", home, env)
            took = time.monotonic() - started
            print(f"check_extras: fenced[{extra}] alone: ok ({took:.0f} s)" if extra else
                  f"check_extras: fenced alone: ok ({took:.0f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "dist"))
