"""The settings registry: the Python package reads COMMD_* variables only through
``commd._settings`` and only names the registry has, and ``commd config --client`` prints every
registered setting with its effective value and source, refusing a bad value by name."""

import ast
import os
import subprocess
from pathlib import Path

import commd._native as native
from conftest import COMMD

PKG = Path(__file__).resolve().parent.parent / "client-py" / "python" / "commd"
READERS = {"get", "raw", "flag", "size", "gbps"}


def _is_environ(node):
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def _names(tree):
    """Module-level string constants (``ENV = "COMMD_VLLM"``), so a read through one counts."""
    out = {}
    for n in tree.body:
        if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)):
            out[n.targets[0].id] = n.value.value
    return out


def _text(node, consts):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    return None


def environment_reads(path):
    """(line, name) of every read of the environment in ``path``; name None when not a literal."""
    tree = ast.parse(path.read_text())
    consts = _names(tree)
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            get = isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value)
            getenv = (isinstance(f, ast.Attribute) and f.attr == "getenv"
                      and isinstance(f.value, ast.Name) and f.value.id == "os")
            if (get or getenv) and node.args:
                reads.append((node.lineno, _text(node.args[0], consts)))
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) \
                and isinstance(node.ctx, ast.Load):
            reads.append((node.lineno, _text(node.slice, consts)))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            reads.append((node.lineno, _text(node.left, consts)))
    return reads


def settings_calls(path):
    """(line, name) of every ``_settings.<reader>(NAME, ...)`` call in ``path``."""
    tree = ast.parse(path.read_text())
    consts = _names(tree)
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in READERS and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "_settings" and node.args):
            out.append((node.lineno, _text(node.args[0], consts)))
    return out


def test_the_package_reads_commd_settings_only_through_the_registry():
    offences = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "_settings.py":
            continue
        for line, name in environment_reads(path):
            if name is None or name.startswith("COMMD_"):
                offences.append(f"{path.relative_to(PKG)}:{line}: reads {name or 'a computed name'}")
    assert not offences, "read COMMD_* settings through commd._settings:\n" + "\n".join(offences)


def test_every_name_the_package_reads_is_registered():
    names = set(native.setting_names())
    calls = [(p, line, n) for p in sorted(PKG.rglob("*.py")) for line, n in settings_calls(p)]
    assert calls, "no reads through commd._settings found: the scan is broken"
    missing = [f"{p.relative_to(PKG)}:{line}: {n}" for p, line, n in calls if n not in names]
    assert not missing, "not in settings/src/keys.rs:\n" + "\n".join(missing)


def test_the_scan_finds_a_direct_read(tmp_path):
    # The check above must be able to fail: a module reading the environment directly is found.
    p = tmp_path / "m.py"
    p.write_text('import os\nENV = "COMMD_X"\na = os.environ.get(ENV)\nb = os.environ["COMMD_Y"]\n'
                 'c = "COMMD_Z" in os.environ\nd = os.getenv("HOME")\n')
    assert sorted(environment_reads(p)) == [(3, "COMMD_X"), (4, "COMMD_Y"), (5, "COMMD_Z"),
                                            (6, "HOME")]


def test_unregistered_names_are_refused_by_the_reader():
    import commd._settings as settings
    try:
        settings.get("COMMD_NO_SUCH_SETTING")
    except KeyError as e:
        assert "COMMD_NO_SUCH_SETTING" in str(e)
    else:
        raise AssertionError("an unregistered name was read")


def client_config(env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("COMMD_")}
    e.update(env)
    return subprocess.run([COMMD, "config", "--client"], capture_output=True, text=True, env=e,
                          timeout=30)


def test_config_client_prints_every_setting_and_its_source():
    out = client_config({"COMMD_GPU_WAIT": "kernel"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for name in native.setting_names():
        assert any(l.startswith(name + " ") for l in lines), f"{name} not printed"
    wait = next(l for l in lines if l.startswith("COMMD_GPU_WAIT "))
    assert "kernel" in wait and "[env; client]" in wait, wait
    spin = next(l for l in lines if l.startswith("COMMD_CLIENT_SPIN_US "))
    assert "50" in spin and "[default; client]" in spin, spin


def test_config_client_refuses_a_bad_value_by_name():
    out = client_config({"COMMD_P2P_DIRECT": "sometimes", "COMMD_GRAPH_DIRECT_BLOCKS": "5000"})
    assert out.returncode == 2, out
    bad = [l for l in out.stdout.splitlines() if "INVALID" in l]
    assert any("COMMD_P2P_DIRECT=" in l and "sometimes" in l for l in bad), out.stdout
    assert any("COMMD_GRAPH_DIRECT_BLOCKS=" in l and "from 1 to 1024" in l for l in bad), out.stdout
