"""nox sessions: tests, lint, demo. Every install passes -c constraints.txt (torch==2.13.0 here)."""

import nox

nox.options.sessions = ["lint", "tests"]
CONSTRAINTS = ("-c", "constraints.txt")


@nox.session(python="3.11")
def tests(session):
    session.install(*CONSTRAINTS, "-e", ".[test]")
    env = {"OMP_NUM_THREADS": "1"}
    if session.posargs:  # a file, a -k, ...: as given
        session.run("python", "-m", "pytest", "-q", *session.posargs, env=env)
        return
    # the README's command: the timing-sensitive files beside the others (tests/run.sh says why)
    session.run("bash", "tests/run.sh", env={"PYTHON": f"{session.bin}/python"}, external=True)


@nox.session(python="3.11")
def lint(session):
    session.install("ruff>=0.6")
    session.run("ruff", "check", "src", "tests", "benchmarks", "examples", "noxfile.py")
    # the layering contract in pyproject.toml: imports only go down the layers
    session.install(*CONSTRAINTS, "-e", ".", "import-linter>=2.1")
    session.run("lint-imports")


@nox.session(python="3.11")
def demo(session):
    session.install(*CONSTRAINTS, "-e", ".[auto]")
    session.run("python", "-m", "composable_atorch", "demo", *session.posargs)
