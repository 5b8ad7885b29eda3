"""Run functions of a reference implementation that lives in a ``--no-deps`` overlay, in a
subprocess that alone puts the overlay on its path.

The references pin other versions than omnistep's venv (qwen-tts: transformers 4.57; chatterbox-tts:
torch 2.6; voxcpm: gradio, funasr, ...). The Makefile installs each, without its dependencies, into
``.ref/<name>``; a subprocess of the venv's python puts that folder first on its path, prepares
its imports (``Overlay.prepare``: bare packages whose ``__init__`` is not run, empty stub modules
for imports the compared paths never call), and calls one function. Arguments and the return
value cross the process boundary by pickle: numpy arrays, numbers, strings, paths, lists and
dicts of them.

Each family's ``tests/<family>_ref/env.py`` declares its ``Overlay`` (which folder, which packages
it registers bare, which modules it stubs) and runs ``OVERLAY.serve_main()`` as its ``__main__``;
this module holds the one implementation of the subprocess round trip:

- ``Overlay.call``: one fresh subprocess per call (request and reply through pickle files).
- ``ReferenceSession``: one long-lived subprocess answering many calls (a model loaded once stays
  between calls), requests over its stdin, replies over a duplicate of its original stdout.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class ReferenceRunError(RuntimeError):
    """The reference subprocess failed; the message carries its traceback or stderr tail."""


@dataclasses.dataclass(frozen=True)
class Overlay:
    """One reference overlay.

    Attributes:
        folder: the overlay's folder under ``.ref/`` (``"qwen-tts"``); None for a reference that
            runs on the venv alone (transformers' Higgs Audio v2) but in its own process.
        package: the top-level package the overlay must hold (``"qwen_tts"``): its absence means
            ``make install-test`` has not run; None with ``folder`` None.
        env_module: the module run as the subprocess (``"tests.qwen3_tts_ref.env"``); its
            ``__main__`` calls ``serve_main``.
        bare_packages: packages registered with the overlay's folder as ``__path__`` and without
            running their ``__init__`` (which would import what the overlay lacks).
        stub_modules: empty modules put in ``sys.modules`` for imports at module level that the
            compared paths never call.
        env: extra environment variables of the subprocess (set only where not already set).
    """

    folder: str | None
    package: str | None
    env_module: str
    bare_packages: tuple[str, ...] = ()
    stub_modules: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def ref_dir(self) -> Path:
        """``.ref/<folder>`` of this checkout (the repository itself without an overlay)."""
        return REPO / ".ref" / self.folder if self.folder else REPO

    # ------------------------------------------------------------ driver side

    def check_installed(self) -> None:
        """Raises FileNotFoundError naming the overlay when its package is missing."""
        if self.package and not (self.ref_dir / self.package).is_dir():
            raise FileNotFoundError(
                f"{self.ref_dir} has no {self.package}: run `make install-test` first"
            )

    def child_env(self) -> dict[str, str]:
        """The subprocess's environment: the overlay, then the repository, on its path."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(self.ref_dir), str(REPO)]))
        for key, value in self.env:
            env.setdefault(key, value)
        return env

    def call(self, target: str, timeout: float = 600, **kwargs: Any) -> Any:
        """Call ``target`` (``"package.module:function"``) with ``kwargs`` in a fresh subprocess.

        Raises:
            FileNotFoundError: the overlay is not installed (``make install-test``).
            ReferenceRunError: the function raised or the subprocess died (message: its stderr).
            subprocess.TimeoutExpired: the call ran past ``timeout`` seconds.
        """
        self.check_installed()
        with tempfile.TemporaryDirectory(prefix=f"{self.folder or 'venv'}-ref-") as tmp:
            request, reply = Path(tmp) / "request.pkl", Path(tmp) / "reply.pkl"
            request.write_bytes(pickle.dumps((target, kwargs)))
            done = subprocess.run(
                [sys.executable, "-m", self.env_module, str(request), str(reply)],
                cwd=REPO,
                env=self.child_env(),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if done.returncode != 0 or not reply.exists():
                raise ReferenceRunError(
                    f"{target} failed (rc={done.returncode}):\n{done.stderr[-4000:]}"
                )
            return pickle.loads(reply.read_bytes())

    # ------------------------------------------------------------ subprocess side

    def bare_package(self, name: str, folder: Path | None = None) -> None:
        """Register ``name`` as a package over ``folder`` (default: its dotted path under the
        overlay) without running its ``__init__`` (subprocess only)."""
        if name in sys.modules:
            return
        package = types.ModuleType(name)
        package.__path__ = [str(folder or self.ref_dir.joinpath(*name.split(".")))]
        package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = package

    def prepare(self) -> None:
        """Register ``bare_packages`` and ``stub_modules`` (subprocess only)."""
        for name in self.bare_packages:
            self.bare_package(name)
        for name in self.stub_modules:
            if name not in sys.modules:
                module = types.ModuleType(name)
                module.__spec__ = importlib.machinery.ModuleSpec(name, None)
                sys.modules[name] = module

    def serve_main(self, argv: list[str]) -> None:
        """The subprocess's entry: ``--serve`` answers a ``ReferenceSession``; ``REQUEST REPLY``
        answers one ``call`` through pickle files."""
        self.prepare()
        if argv[:1] == ["--serve"]:
            _serve()
            return
        request, reply = argv
        target, kwargs = pickle.loads(Path(request).read_bytes())
        Path(reply).write_bytes(pickle.dumps(_resolve(target)(**kwargs)))


def _resolve(target: str) -> Any:
    module_name, _, func_name = target.partition(":")
    return getattr(importlib.import_module(module_name), func_name)


def _serve() -> None:
    """The ``ReferenceSession`` side: answer pickled ``(target, kwargs)`` requests until EOF."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints of the reference (fd 1) go to stderr, never into the replies
    requests = sys.stdin.buffer
    while True:
        try:
            target, kwargs = pickle.load(requests)
        except EOFError:
            break
        try:
            reply = ("ok", _resolve(target)(**kwargs))
        except Exception:
            reply = ("error", traceback.format_exc())
        pickle.dump(reply, replies)
        replies.flush()


class ReferenceSession:
    """A long-lived reference subprocess of ``overlay``: ``call`` runs functions in it one after
    another, and what they keep in module globals (a loaded model) stays between calls. The
    subprocess waits on its stdin between calls (no CPU).

    Requests and replies are pickled over the subprocess's stdin and a duplicate of its
    original stdout; its own prints go to its stderr, which is kept in a temporary file and
    quoted when a call fails. Use as a context manager (or call ``close``).

    ``module``: calls may name a function of this module alone (``call("bench_load")``).

    Raises (from ``__init__``): FileNotFoundError: the overlay is not installed.
    """

    def __init__(self, overlay: Overlay, module: str | None = None) -> None:
        overlay.check_installed()
        self.module = module
        # kept open for the session's life (the subprocess writes to it); closed by close()
        self._stderr = tempfile.TemporaryFile(prefix=f"{overlay.folder or 'venv'}-ref-session-")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", overlay.env_module, "--serve"],
            cwd=REPO,
            env=overlay.child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )

    @property
    def pid(self) -> int:
        """The subprocess's process id."""
        return self.proc.pid

    def stderr_tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters the subprocess wrote to its stderr."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:]

    def call(self, target: str, **kwargs: Any) -> Any:
        """Run ``target`` (``"package.module:function"``, or a function of ``module``) with
        ``kwargs`` in the subprocess.

        Raises:
            ReferenceRunError: the function raised (its traceback) or the subprocess died (its
                stderr tail).
        """
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.module and ":" not in target:
            target = f"{self.module}:{target}"
        try:
            pickle.dump((target, kwargs), self.proc.stdin)
            self.proc.stdin.flush()
            status, value = pickle.load(self.proc.stdout)
        except (BrokenPipeError, EOFError, pickle.UnpicklingError) as exc:
            self.proc.wait(timeout=30)
            raise ReferenceRunError(
                f"{target}: the reference subprocess died (rc={self.proc.returncode}, "
                f"{type(exc).__name__}):\n{self.stderr_tail()}"
            ) from exc
        if status != "ok":
            raise ReferenceRunError(f"{target} failed:\n{value}")
        return value

    def close(self) -> None:
        """End the subprocess (EOF on its stdin; killed if it has not ended after 30 s)."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()

    def __enter__(self) -> ReferenceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
