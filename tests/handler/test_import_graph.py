"""handler/'s rooms import one way: no cycle, no room importing a later room, no unexplained lazy import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.handler.import_graph import check

HANDLER = Path(__file__).resolve().parents[2] / "handler"
ROOMS = ("model", "grammar", "engine", "adapters", "serving", "embed")
SHARED = ("threads",)
ENTRY = "cli"  # `lorafarm replica`: the one module over every room (it starts a replica or an embedding worker)
OWN = ("lorafarm", "archives", "registry", "router")
FORBIDDEN = ("registry", "router")  # other services: a replica talks to them over HTTP only


def handler_graph():
    return check(HANDLER, "handler", (*ROOMS, ENTRY), SHARED, OWN, FORBIDDEN)


def test_handler_has_no_import_cycle():
    cycles = handler_graph().cycles
    assert cycles == [], "module-level import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_handler_rooms_import_only_earlier_rooms():
    violations = handler_graph().violations
    assert violations == [], "imports against the room order:\n" + "\n".join(violations)


def test_handler_function_level_imports_say_why():
    unexplained = handler_graph().unexplained
    assert unexplained == [], "function-level imports of our own modules without a lazy/why: comment:\n" + "\n".join(
        unexplained
    )


def test_handler_rooms_are_the_documented_ones():
    rooms = sorted(p.name for p in HANDLER.iterdir() if (p / "__init__.py").exists())
    assert rooms == sorted(ROOMS), f"handler/ sub-packages {rooms} are not the rooms {ROOMS} this test checks"
    shared = sorted(p.stem for p in HANDLER.glob("*.py") if p.name != "__init__.py")
    assert shared == sorted((*SHARED, ENTRY)), f"modules directly under handler/ {shared} are not {SHARED} + {ENTRY}"


def test_grammar_worker_imports_stay_light():
    """A grammar worker imports handler.grammar.pool (and so constrained) at start: no torch, no
    transformers, no llguidance until a job compiles, nothing of handler/ but the grammar room and threads."""
    code = (
        "import sys; from handler.grammar.pool import _worker_main; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'llguidance')"
        " or m.startswith('handler.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=HANDLER.parent).stdout.strip()
    assert out == "['handler.grammar', 'handler.grammar.constrained', 'handler.grammar.pool', 'handler.threads']", out


# The checker itself, on tiny synthetic packages.


def write_package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return pkg


def check_pkg(pkg: Path):
    return check(pkg, "pkg", ("low", "high"), ("shared",), ("other", "service"), ("service",))


def test_checker_reports_a_two_module_cycle(tmp_path):
    pkg = write_package(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/a.py": "from pkg.low.b import thing\n",
            "low/b.py": "from pkg.low import a\nthing = 1\n",
            "low/c.py": "import pkg.low.a\n",  # imports into the cycle, not part of it
        },
    )
    graph = check_pkg(pkg)
    assert graph.cycles == [["pkg.low.a", "pkg.low.b"]], graph.cycles
    assert graph.violations == [] and graph.unexplained == []


def test_checker_reports_a_cycle_through_relative_imports_and_a_package_init(tmp_path):
    pkg = write_package(
        tmp_path,
        {
            "low/__init__.py": "from .a import x\n",
            "low/a.py": "from . import b\nx = 1\n",
            "low/b.py": "from pkg.low import x\n",  # a name, so the package's __init__
        },
    )
    assert check_pkg(pkg).cycles == [["pkg.low", "pkg.low.a", "pkg.low.b"]]


def test_checker_ignores_type_checking_and_function_level_imports_for_cycles(tmp_path):
    pkg = write_package(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low import b\n",
            "low/b.py": """\
                from pkg.low import a
                def f():
                    from pkg.low import c  # lazy: why not
                """,
            "low/c.py": "from pkg.low import b\n",
        },
    )
    graph = check_pkg(pkg)
    assert graph.cycles == [] and graph.unexplained == [], graph


def test_checker_reports_a_function_level_import_without_a_why(tmp_path):
    pkg = write_package(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/a.py": """\
                import json
                def f():
                    import os  # stdlib and third-party imports are not ours to explain
                    from pkg.low import b
                    return b
                class K:
                    def g(self):
                        # why: the other package imports torch, and workers must not
                        from other import heavy
                        import other.thing
                """,
            "low/b.py": "",
        },
    )
    unexplained = check_pkg(pkg).unexplained
    assert len(unexplained) == 2, unexplained
    assert "pkg.low.a imports pkg.low.b inside a function" in unexplained[0], unexplained
    assert "pkg.low.a imports other.thing inside a function" in unexplained[1], unexplained
    assert unexplained[0].startswith("pkg/low/a.py:4 "), unexplained


def test_checker_reports_a_room_importing_a_later_room(tmp_path):
    pkg = write_package(
        tmp_path,
        {
            "shared.py": "",
            "low/__init__.py": "",
            "low/a.py": "from pkg import shared\nfrom pkg.high.h import y\n",
            "high/__init__.py": "",
            "high/h.py": "from pkg.low.a import z\nfrom pkg import shared\ny = 1\n",
        },
    )
    graph = check_pkg(pkg)
    assert len(graph.violations) == 1, graph.violations
    assert "pkg.low.a (low) imports pkg.high.h (high), a room after it" in graph.violations[0]
    assert graph.cycles == [["pkg.high.h", "pkg.low.a"]]


def test_checker_reports_a_lazy_layering_violation_a_shared_module_importing_a_room_and_a_forbidden_import(tmp_path):
    pkg = write_package(
        tmp_path,
        {
            "shared.py": "from pkg.low import a\n",
            "low/__init__.py": "",
            "low/a.py": "def f():\n    from pkg.high import h  # lazy: still against the order\n",
            "high/__init__.py": "",
            "high/h.py": "import service.api\n",
            "stray/__init__.py": "",
            "stray/s.py": "from pkg.low import a\n",
        },
    )
    violations = check_pkg(pkg).violations
    assert len(violations) == 4, violations
    text = "\n".join(violations)
    assert "pkg.high.h imports service.api: pkg may not import service" in text
    assert "pkg.low.a (low) imports pkg.high.h (high), a room after it" in text
    assert "pkg.shared (shared) imports pkg.low.a" in text
    assert "pkg.stray.s is in no room" in text
