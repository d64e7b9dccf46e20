"""A small Dockerfile parser and the rules this repository's Dockerfile must keep (checked in CI, where
there is no Docker engine to build it). hadolint runs too (tests/docker/test_dockerfile.py); these rules
are the ones specific to weightsync: the two targets, pinned bases, numeric non-root users, console-script
entrypoints, COPY sources that exist and reach the build context, no torch in the operator.

    problems = check(Path("Dockerfile").read_text(), repo=Path("."))   # [] when everything holds
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

TARGETS = ("operator", "agent")
# Extras whose packages must never reach the operator image (they pull torch / nixl).
AGENT_ONLY_EXTRAS = ("agent", "gdr")
AGENT_ONLY_PACKAGES = ("torch", "nixl", "numpy", "xxhash")
PIP_CACHE = "/root/.cache/pip"  # pip's cache dir for root, where the builds run pip


@dataclass(frozen=True)
class Instruction:
    line: int       # 1-based line of the instruction's first line
    cmd: str        # upper case: FROM, RUN, COPY, ...
    value: str      # the rest, continuation lines joined with a space
    flags: tuple[str, ...] = ()  # leading --flags (COPY --from=..., RUN --mount=...)

    @property
    def is_exec_form(self) -> bool:
        try:
            parsed = json.loads(self.value)
        except ValueError:
            return False
        return isinstance(parsed, list) and bool(parsed) and all(isinstance(a, str) for a in parsed)

    def argv(self) -> list[str]:
        """The exec-form array, or a shell form wrapped like Docker does."""
        if self.is_exec_form:
            return list(json.loads(self.value))
        return ["/bin/sh", "-c", self.value]


@dataclass
class Stage:
    name: str | None
    base: str                     # the FROM image (ARGs resolved) or a previous stage's name
    line: int
    instructions: list[Instruction] = field(default_factory=list)


def parse(text: str) -> list[Instruction]:
    """Instructions of TEXT: comments and blank lines dropped, `\\` continuations joined (a comment line
    inside a continuation is skipped, as Docker does), flags split off."""
    out: list[Instruction] = []
    buf: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf.append(stripped[:-1].strip())
            continue
        buf.append(stripped)
        joined = " ".join(p for p in buf if p)
        buf = []
        cmd, _, rest = joined.partition(" ")
        rest = rest.strip()
        flags: list[str] = []
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            flags.append(flag)
            rest = rest.strip()
        out.append(Instruction(start, cmd.upper(), rest, tuple(flags)))
    if buf:
        raise ValueError(f"line {start}: the file ends inside a continued instruction")
    return out


def substitute(value: str, args: dict[str, str]) -> str:
    """${NAME}, ${NAME:-default} and $NAME from ARG defaults."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        default = m.group(2)
        return args.get(name) or (default or "")

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", repl, value)


def stages(instructions: Iterable[Instruction]) -> list[Stage]:
    global_args: dict[str, str] = {}
    result: list[Stage] = []
    for ins in instructions:
        if ins.cmd == "ARG" and not result:
            name, _, default = ins.value.partition("=")
            global_args[name.strip()] = default.strip().strip('"')
        elif ins.cmd == "FROM":
            parts = ins.value.split()
            base = substitute(parts[0], global_args)
            stage_name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            result.append(Stage(stage_name, base, ins.line))
        elif result:
            result[-1].instructions.append(ins)
        else:
            raise ValueError(f"line {ins.line}: {ins.cmd} before the first FROM")
    return result


def chain(all_stages: list[Stage], target: Stage) -> list[Stage]:
    """TARGET and the stages it is built FROM, outermost first."""
    by_name = {s.name: s for s in all_stages if s.name}
    out = [target]
    while out[0].base in by_name and by_name[out[0].base] not in out:
        out.insert(0, by_name[out[0].base])
    return out


def effective(all_stages: list[Stage], target: Stage, cmd: str) -> Instruction | None:
    """The last CMD-instruction (USER, ENTRYPOINT, ...) in force for TARGET, inherited ones included."""
    found = None
    for stage in chain(all_stages, target):
        for ins in stage.instructions:
            if ins.cmd == cmd:
                found = ins
    return found


# --- .dockerignore ---------------------------------------------------------------------------------------------
def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            if i < len(pattern) and pattern[i] == "/":
                out = out[:-2] + "(?:.*/)?"
                i += 1
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def dockerignore_excludes(patterns_text: str, path: str) -> bool:
    """Whether PATH (relative, '/'-separated) is left out of the build context: a pattern matching the
    path or one of its parent folders excludes it; a later `!pattern` brings it back (Docker's rules)."""
    rules: list[tuple[bool, re.Pattern[str]]] = []
    for line in patterns_text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        line = line[1:].strip() if negate else line
        line = re.sub(r"/+", "/", line).strip("/")
        if line.startswith("./"):
            line = line[2:]
        rules.append((negate, _pattern_regex(line)))
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negate, rx in rules:
        if any(rx.match(p) for p in prefixes):
            excluded = not negate
    return excluded


# --- the rules -------------------------------------------------------------------------------------------------
PINNED_TAG = re.compile(r"(?:^|[^0-9])\d+\.\d+\.\d+(?:[^0-9]|$)")
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def _image_pinned(image: str) -> str | None:
    """None when IMAGE names a full version (x.y.z) tag and/or a digest; else what is wrong."""
    if DIGEST.search(image):
        return None
    _name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
    if not tag:
        return f"{image!r} has no tag (it means :latest)"
    if tag == "latest":
        return f"{image!r} uses :latest"
    if not PINNED_TAG.search(tag):
        return f"{image!r}: tag {tag!r} is not a full version (x.y.z)"
    return None


def _pip_installs(ins: Instruction) -> list[list[str]]:
    """The argument lists of every `pip install` / `pip wheel` in a RUN (shell form)."""
    if ins.cmd != "RUN":
        return []
    cmds = []
    for part in re.split(r"&&|\|\||;|\|", ins.value):
        try:
            words = shlex.split(part)
        except ValueError:
            words = part.split()
        for i, w in enumerate(words):
            if w in ("pip", "pip3") or w.endswith("/pip") or (w == "-m" and i + 1 < len(words) and words[i + 1] == "pip"):
                j = i + 2 if w == "-m" else i + 1
                if j < len(words) and words[j] in ("install", "wheel"):
                    cmds.append(words[j:])
                break
    return cmds


def _pip_cache_mounted(ins: Instruction) -> bool:
    """A cache mount at pip's cache dir: downloads are reused between builds and never land in a layer."""
    for flag in ins.flags:
        if flag.startswith("--mount="):
            opts = dict(kv.partition("=")[::2] for kv in flag.removeprefix("--mount=").split(","))
            if opts.get("type") == "cache" and opts.get("target", opts.get("dst")) == PIP_CACHE:
                return True
    return False


def _env_sets(ins: Instruction, name: str) -> bool:
    return ins.cmd == "ENV" and re.search(rf"(?:^|\s){name}=(?:1|true|yes|on|\"1\")(?:\s|$)", ins.value, re.I) is not None


def check(text: str, repo: Path, dockerignore: str | None = None, pyproject: dict | None = None) -> list[str]:
    """Every rule broken by Dockerfile TEXT, as readable lines (empty: all good). REPO is the build context;
    DOCKERIGNORE and PYPROJECT default to the files in it."""
    if dockerignore is None:
        ignore_file = repo / ".dockerignore"
        dockerignore = ignore_file.read_text() if ignore_file.exists() else ""
    if pyproject is None:
        pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    scripts: dict[str, str] = pyproject["project"].get("scripts", {})
    package_dirs = set(pyproject["tool"]["setuptools"].get("package-dir", {}).values())

    problems: list[str] = []
    instructions = parse(text)
    all_stages = stages(instructions)
    names = {s.name for s in all_stages}
    by_name = {s.name: s for s in all_stages if s.name}

    # Targets.
    for target in TARGETS:
        if target not in names:
            problems.append(f"no `FROM ... AS {target}` stage: `docker build --target {target}` would fail")

    # Pinned bases.
    for s in all_stages:
        if s.base in names:
            continue
        why = _image_pinned(s.base)
        if why:
            problems.append(f"line {s.line}: base image not pinned: {why}")

    for ins in instructions:
        # No ADD of remote sources.
        if ins.cmd == "ADD":
            if re.search(r"(?:^|\s)(?:https?://|git@|[\w.-]+\.git\b)", ins.value):
                problems.append(f"line {ins.line}: ADD of a URL (download in a RUN with a checksum, or COPY)")
            else:
                problems.append(f"line {ins.line}: ADD: use COPY for local files")
        # Exec form only.
        if ins.cmd in ("ENTRYPOINT", "CMD") and not ins.is_exec_form:
            problems.append(f"line {ins.line}: {ins.cmd} in shell form ({ins.value!r}): use the exec form [\"...\"] "
                            "so signals reach the process")
        # COPY sources exist in the context.
        if ins.cmd == "COPY" and not any(f.startswith("--from") for f in ins.flags):
            words = json.loads(ins.value) if ins.is_exec_form else ins.value.split()
            for src in words[:-1]:
                rel = src.removeprefix("./")
                if not (repo / rel).exists():
                    problems.append(f"line {ins.line}: COPY source {src!r} does not exist in the repository")
                elif dockerignore_excludes(dockerignore, rel):
                    problems.append(f"line {ins.line}: COPY source {src!r} is excluded by .dockerignore")

    # pip never keeps a cache.
    for s in all_stages:
        no_cache_env = False  # PIP_NO_CACHE_DIR as set by the last ENV before the RUN (inherited stages first)
        for ins in (i for st in chain(all_stages, s) for i in st.instructions):
            if ins.cmd == "ENV" and re.search(r"(?:^|\s)PIP_NO_CACHE_DIR=", ins.value):
                no_cache_env = _env_sets(ins, "PIP_NO_CACHE_DIR")
            if ins not in s.instructions:
                continue
            for args in _pip_installs(ins):
                if "--no-cache-dir" not in args and not no_cache_env and not _pip_cache_mounted(ins):
                    problems.append(f"line {ins.line}: `pip {' '.join(args[:1])}` without --no-cache-dir "
                                    f"(or ENV PIP_NO_CACHE_DIR=1, or RUN --mount=type=cache,target={PIP_CACHE}): "
                                    "the image keeps pip's cache")
                if args[0] == "install" and s.name in TARGETS and "--constraint" not in args and "-c" not in args:
                    problems.append(f"line {ins.line}: target {s.name}: `pip install` without --constraint: the "
                                    "image would not install the locked versions the tests run (constraints.txt)")

    # The builder copies every package folder of the distribution.
    wheel_stages = [s for s in all_stages if any(a[0] == "wheel" for i in s.instructions for a in _pip_installs(i))]
    if not wheel_stages:
        problems.append("no stage builds the wheel (`pip wheel ... .`)")
    for s in wheel_stages:
        copied: set[str] = set()
        for ins in s.instructions:
            if ins.cmd == "COPY" and not ins.flags:
                copied.update(w.rstrip("/").removeprefix("./") for w in ins.value.split()[:-1])
        for folder in sorted(package_dirs - copied):
            problems.append(f"stage {s.name}: package folder {folder!r} ([tool.setuptools] package-dir) is not "
                            "copied before `pip wheel`: the wheel would miss it")
        for needed in ("pyproject.toml", "README.md"):
            if needed not in copied:
                problems.append(f"stage {s.name}: {needed} is not copied before `pip wheel`")

    for target in TARGETS:
        stage = by_name.get(target)
        if stage is None:
            continue
        # Numeric, non-root user.
        user = effective(all_stages, stage, "USER")
        if user is None:
            problems.append(f"target {target}: no USER: the container runs as root")
        else:
            uid, _, gid = user.value.partition(":")
            if not uid.isdigit() or (gid and not gid.isdigit()):
                problems.append(f"target {target}: USER {user.value!r} is not numeric (runAsNonRoot cannot verify a name)")
            elif int(uid) == 0 or (gid and int(gid) == 0):
                problems.append(f"target {target}: USER {user.value!r} is root")
        # Entrypoint: a console script of the distribution.
        entry = effective(all_stages, stage, "ENTRYPOINT")
        if entry is None:
            problems.append(f"target {target}: no ENTRYPOINT")
        elif entry.is_exec_form:
            argv0 = entry.argv()[0]
            if argv0 not in scripts:
                problems.append(f"target {target}: ENTRYPOINT {argv0!r} is not a [project.scripts] console script "
                                f"({sorted(scripts)})")
        # What each target installs.
        installs = [a for st in chain(all_stages, stage) for i in st.instructions for a in _pip_installs(i)
                    if a[0] == "install"]
        if not installs:
            problems.append(f"target {target}: installs nothing (no `pip install`)")
        words = " ".join(w for a in installs for w in a[1:])
        extras = {e.strip() for group in re.findall(r"\[([^\]]*)\]", words) for e in group.split(",")}
        if target == "operator":
            bad = sorted(extras & set(AGENT_ONLY_EXTRAS))
            if bad:
                problems.append(f"target operator installs the {bad} extra(s): torch / nixl in the operator image")
            for pkg in AGENT_ONLY_PACKAGES:
                if re.search(rf"(?:^|\s){pkg}(?:[=<>!~\s]|$)", words):
                    problems.append(f"target operator installs {pkg!r} directly")
        if target == "agent":
            missing = sorted(set(AGENT_ONLY_EXTRAS) - extras)
            if missing:
                problems.append(f"target agent does not install the {missing} extra(s): no torch / nixl for the transports")
    return problems


def target_argv(text: str, target: str) -> list[str]:
    """The command the TARGET image runs by default: ENTRYPOINT + CMD (exec form)."""
    all_stages = stages(parse(text))
    stage = next(s for s in all_stages if s.name == target)
    entry = effective(all_stages, stage, "ENTRYPOINT")
    cmd = effective(all_stages, stage, "CMD")
    return (entry.argv() if entry else []) + (cmd.argv() if cmd else [])
