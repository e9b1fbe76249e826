"""The project's locks: every distribution each install takes, at one version, with its hashes.

Each install the project makes has a lock in ``locks/``, resolved by uv from pyproject.toml's
requirements, the constraints file of that install and the lock's Python and platform:

  dev            make install, CI: every extra the tests need (Python 3.11, linux x86_64)
  operator       images/operator.Dockerfile (Python 3.11)
  trainer-cpu    images/trainer.Dockerfile without the gpu extra (Debian 12's Python 3.11)
  trainer-gpu    images/trainer.Dockerfile with the gpu extra (Ubuntu 24.04's Python 3.12)
  sglang-runtime the SGLang wheel the tests read and the pure-Python modules its weight updater
                 imports, installed without dependencies beside the virtualenv (test only)

  python hack/lock.py compile [NAME ...]  re-resolve from PyPI (needs uv and the network)
  python hack/lock.py check               offline: each lock satisfies pyproject.toml's
                                          requirements and its constraints file's pins
  python hack/lock.py drift [NAME|PATH]   this interpreter's installed distributions are exactly
                                          the lock's (default: dev)
  python hack/lock.py unlocked [NAME|PATH] the installed distributions the lock lacks (to remove)
  python hack/lock.py newest OUT          resolve the dev lock's inputs afresh (newest allowed)
                                          into OUT and print how it differs from locks/dev.txt
  python hack/lock.py without LOCK PAT..  LOCK's text without the entries whose names match
  python hack/lock.py only LOCK PAT..     LOCK's text with only those entries

``without`` and ``only`` use the standard library alone: the Dockerfiles run them before anything
is installed. ``check`` needs ``packaging``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "locks"
# the project's own distribution: installed from the source tree, never from a lock
PROJECT = "ppojob"


@dataclass(frozen=True)
class LockSpec:
    """One install: the extras it takes, its constraints, the Python and platform it runs on."""

    name: str
    python: str
    platform: str
    extras: tuple[str, ...] = ()
    constraints: str = "constraints.txt"
    # requirements beyond the project's (the installer itself, a build backend...)
    extra_requirements: tuple[str, ...] = ()
    # requirement files read as they are, and no dependencies followed (the sglang runtime)
    requirement_files: tuple[str, ...] = ()
    no_deps: bool = False
    # a uv configuration file (static metadata of an sdist that cannot build here)
    uv_config: str | None = None
    include_project: bool = True


# the installer and the build backend of pyproject.toml ([build-system]); the project installs
# without build isolation, so with these very versions
_BUILD = ("pip", "setuptools>=77")

SPECS: dict[str, LockSpec] = {
    spec.name: spec
    for spec in (
        LockSpec(
            "dev",
            "3.11",
            "x86_64-manylinux_2_28",
            ("operator", "trainer", "trackers", "dev"),
            extra_requirements=_BUILD,
        ),
        LockSpec(
            "operator", "3.11", "x86_64-manylinux_2_28", ("operator",), extra_requirements=_BUILD
        ),
        LockSpec(
            "trainer-cpu",
            "3.11",
            "x86_64-manylinux_2_28",
            ("trainer", "trackers"),
            extra_requirements=_BUILD,
        ),
        LockSpec(
            "trainer-gpu",
            "3.12",
            "x86_64-manylinux_2_39",
            ("trainer", "trackers", "gpu"),
            constraints="constraints-gpu.txt",
            # megatron-core's fused layers and varlen attention; its torch extension is an
            # sdist (the image compiles it), whose metadata locks/uv-gpu.toml states
            extra_requirements=(*_BUILD, "transformer-engine[pytorch,core-cu13]"),
            uv_config="locks/uv-gpu.toml",
        ),
        LockSpec(
            "sglang-runtime",
            "3.11",
            # sglang publishes manylinux_2_34 wheels only
            "x86_64-manylinux_2_34",
            requirement_files=("tests/trainer/backends/sglang-runtime.txt",),
            no_deps=True,
            include_project=False,
        ),
    )
}


def canonicalize_name(name: str) -> str:
    """PEP 503's normal form of a distribution name (as ``packaging`` spells it)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    if tomllib is None:  # pragma: no cover - Python 3.10 has no tomllib
        raise SystemExit("hack/lock.py needs Python >= 3.11 (tomllib)")
    return tomllib.loads(text)


def sglang_pin() -> str:
    """The gpu extra's ``sglang==X`` (the wheel the tests read)."""
    gpu = _pyproject()["project"]["optional-dependencies"]["gpu"]
    (pin,) = [r for r in gpu if re.match(r"sglang\s*==", r)]
    return pin.replace(" ", "")


def requirements(spec: LockSpec) -> list[str]:
    """What the lock must satisfy: the project's requirements and those of its extras, then the
    spec's own additions (the sglang pin for the runtime lock)."""
    out: list[str] = []
    if spec.include_project:
        project = _pyproject()["project"]
        out += project["dependencies"]
        for extra in spec.extras:
            out += project["optional-dependencies"][extra]
    out += spec.extra_requirements
    for name in spec.requirement_files:
        out += [
            line.split("#", 1)[0].strip()
            for line in (ROOT / name).read_text().splitlines()
            if line.split("#", 1)[0].strip()
        ]
    if spec.name == "sglang-runtime":
        out.append(sglang_pin())
    return out


def parse_lock(text: str) -> dict[str, str]:
    """``{canonical name: version}`` of a hashed requirements file as uv writes it."""
    pins: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)", line)
        if m:
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def read_lock(name: str) -> dict[str, str]:
    path = LOCKS / f"{name}.txt"
    if not path.is_file():
        raise SystemExit(f"locks/{name}.txt is missing: run `make lock`")
    return parse_lock(path.read_text())


def constraint_pins(spec: LockSpec) -> dict[str, str]:
    """The ``name==version`` pins of the spec's constraints file."""
    return parse_lock((ROOT / spec.constraints).read_text()) if spec.include_project else {}


def _environment(spec: LockSpec) -> dict[str, str]:
    """Marker values of the lock's target (linux x86_64 CPython)."""
    return {
        "python_version": spec.python,
        "python_full_version": f"{spec.python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def disagreements(
    spec: LockSpec,
    pins: Mapping[str, str],
    reqs: Iterable[str] | None = None,
    constraints: Mapping[str, str] | None = None,
) -> list[str]:
    """How ``pins`` (a lock) fails the spec: a requirement it lacks or whose range excludes the
    locked version, or a constraint pinned to another version. Empty when they agree.
    ``reqs`` and ``constraints`` default to pyproject.toml's and the spec's constraints file's."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    env = _environment(spec)
    problems = []
    for text in requirements(spec) if reqs is None else reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        if name not in pins:
            problems.append(f"{req} is required but locks/{spec.name}.txt has no {name}")
        elif not req.specifier.contains(Version(pins[name]), prereleases=True):
            problems.append(f"{req} is required but locks/{spec.name}.txt has {name}=={pins[name]}")
    for name, version in (constraint_pins(spec) if constraints is None else constraints).items():
        if name in pins and pins[name] != version:
            problems.append(
                f"{spec.constraints} pins {name}=={version} but locks/{spec.name}.txt has "
                f"{name}=={pins[name]}"
            )
    return problems


def installed_distributions(paths: Iterable[str] | None = None) -> dict[str, str]:
    """``{canonical name: version}`` of the distributions installed in ``paths`` (default: this
    interpreter's environment, its site-packages), the project itself left out."""
    import sysconfig
    from importlib import metadata

    if paths is None:
        paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    found: dict[str, str] = {}
    for dist in metadata.distributions(path=list(paths)):
        name = dist.metadata["Name"]
        if not name:
            continue
        found.setdefault(canonicalize_name(name), dist.version)
    found.pop(PROJECT, None)
    return found


def drift(installed: Mapping[str, str], locked: Mapping[str, str]) -> list[str]:
    """How an environment differs from its lock: a distribution the lock lacks, one at another
    version, one the lock has that is not installed."""
    out = []
    for name in sorted(installed.keys() - locked.keys()):
        out.append(f"{name}=={installed[name]} is installed but not in the lock")
    for name in sorted(installed.keys() & locked.keys()):
        if installed[name] != locked[name]:
            out.append(f"{name}=={installed[name]} is installed; the lock has {locked[name]}")
    for name in sorted(locked.keys() - installed.keys()):
        out.append(f"{name}=={locked[name]} is in the lock but not installed")
    return out


def differences(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """One line per distribution whose version differs between two locks."""
    out = []
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name), new.get(name)
        if a != b:
            out.append(f"  {name}: {a or '(absent)'} -> {b or '(absent)'}")
    return out


def select(text: str, patterns: Iterable[str], *, keep: bool) -> str:
    """A lock's text with only (``keep``) or without the entries (the pin, its hashes, its
    comments) whose names match ``patterns`` (shell-style: ``nvidia-*``)."""
    from fnmatch import fnmatchcase

    pats = [canonicalize_name(p) for p in patterns]
    out, dropping = [], False
    for line in text.splitlines(keepends=True):
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==", line)
        if m:
            hit = any(fnmatchcase(canonicalize_name(m.group(1)), p) for p in pats)
            dropping = hit != keep
        elif line[:1] not in (" ", "\t"):
            dropping = False
        if not dropping:
            out.append(line)
    return "".join(out)


def lock_pins(name: str) -> dict[str, str]:
    """A lock by name (``dev``) or by path (``build/newest.txt``)."""
    return read_lock(name) if name in SPECS else parse_lock(Path(name).read_text())


def _uv() -> str:
    here = Path(sys.executable).parent / "uv"
    if here.exists():
        return str(here)
    return "uv"


def compile_lock(spec: LockSpec, out: Path) -> None:
    """Resolve ``spec`` with uv from PyPI into ``out`` (hashed; the newest versions allowed)."""
    with tempfile.TemporaryDirectory() as tmp:
        reqs = Path(tmp) / f"{spec.name}.in"
        reqs.write_text("\n".join(requirements(spec)) + "\n")
        cmd = [
            _uv(),
            "pip",
            "compile",
            "--quiet",
            "--generate-hashes",
            "--python-version",
            spec.python,
            "--python-platform",
            spec.platform,
            "--custom-compile-command",
            f"make lock  (python hack/lock.py compile {spec.name})",
            "--no-annotate" if spec.no_deps else "--annotation-style=line",
            "-o",
            str(out),
            str(reqs),
        ]
        if spec.include_project:
            cmd += ["-c", str(ROOT / spec.constraints)]
        if spec.no_deps:
            cmd.append("--no-deps")
        if spec.uv_config:
            cmd += ["--config-file", str(ROOT / spec.uv_config)]
        cmd.append("--upgrade")
        env = {**os.environ, "UV_NO_PROGRESS": "1"}
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    # uv names the temporary input file; name what it stands for instead
    text = out.read_text().replace(str(reqs), f"<{spec.name} requirements: hack/lock.py>")
    out.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compile")
    p.add_argument("names", nargs="*")
    sub.add_parser("check")
    p = sub.add_parser("drift")
    p.add_argument("name", nargs="?", default="dev")
    p = sub.add_parser("newest")
    p.add_argument("out", type=Path)
    for name in ("without", "only"):
        p = sub.add_parser(name)
        p.add_argument("lock", type=Path)
        p.add_argument("names", nargs="+")
    p = sub.add_parser("unlocked")
    p.add_argument("name", nargs="?", default="dev")
    args = parser.parse_args(argv)

    if args.command == "compile":
        LOCKS.mkdir(exist_ok=True)
        for name in args.names or list(SPECS):
            if name not in SPECS:
                parser.error(f"no lock {name!r}; the locks: {', '.join(SPECS)}")
            out = LOCKS / f"{name}.txt"
            old = parse_lock(out.read_text()) if out.is_file() else {}
            compile_lock(SPECS[name], out)
            new = read_lock(name)
            changed = differences(old, new)
            print(f"locks/{name}.txt: {len(new)} distributions, {len(changed)} changed")
            print("\n".join(changed)) if changed else None
        return 0
    if args.command == "check":
        problems = [p for spec in SPECS.values() for p in disagreements(spec, read_lock(spec.name))]
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print("the locks disagree with pyproject.toml: run `make lock`", file=sys.stderr)
            return 1
        print(f"{len(SPECS)} locks agree with pyproject.toml and the constraints")
        return 0
    if args.command == "drift":
        problems = drift(installed_distributions(), lock_pins(args.name))
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print(f"this environment is not locks/{args.name}.txt: `make install`", file=sys.stderr)
            return 1
        return 0
    if args.command == "newest":
        compile_lock(SPECS["dev"], args.out)
        changed = differences(read_lock("dev"), parse_lock(args.out.read_text()))
        print(f"the newest versions allowed differ from locks/dev.txt in {len(changed)}:")
        print("\n".join(changed) if changed else "  (none)")
        return 0
    if args.command in ("without", "only"):
        text = select(args.lock.read_text(), args.names, keep=args.command == "only")
        sys.stdout.write(text)
        return 0
    if args.command == "unlocked":
        locked = lock_pins(args.name)
        print("\n".join(sorted(installed_distributions().keys() - locked.keys())))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
