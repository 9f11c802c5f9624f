"""bench/install_missing_wheels.py: only the carried wheels the machine cannot import are installed."""

import zipfile

import pytest

from bench.install_missing_wheels import import_names, main, missing


def _wheel(folder, name, files, top_level=None):
    """A wheel pip can install: ``files`` (paths, or {path: text}) plus its METADATA, WHEEL and RECORD."""
    files = dict.fromkeys(files, "") if not isinstance(files, dict) else files
    dist = f"{name}-1.0.dist-info"
    meta = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
            f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    if top_level is not None:
        meta[f"{dist}/top_level.txt"] = "\n".join(top_level) + "\n"
    entries = {**files, **meta}
    entries[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in [*entries, f"{dist}/RECORD"])
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for f, text in entries.items():
            zf.writestr(f, text)
    return path


def test_import_names_come_from_top_level_txt_else_from_the_record(tmp_path):
    listed = _wheel(tmp_path, "mpl", ["mpl/__init__.py", "pylab.py"], top_level=["mpl", "pylab", "mpl_toolkits"])
    assert import_names(listed) == ["mpl", "mpl_toolkits", "pylab"]
    unlisted = _wheel(tmp_path, "six_like", ["six_like.py", "pkg_a/__init__.py", "pkg_a/sub/x.py",
                                             "_ext.cpython-312-x86_64-linux-gnu.so", "hook.pth",
                                             "six_like-1.0.data/scripts/tool"])
    assert import_names(unlisted) == ["_ext", "pkg_a", "six_like"]


def test_only_wheels_with_a_missing_import_name_are_chosen(tmp_path):
    present = _wheel(tmp_path, "jsonish", ["json/__init__.py"], top_level=["json"])            # stdlib: importable
    absent = _wheel(tmp_path, "nowhere", ["qerl_no_such_module_xyz/__init__.py"])
    partly = _wheel(tmp_path, "mixed", [], top_level=["json", "qerl_no_such_module_abc"])    # one name missing
    assert missing([present, absent, partly]) == [absent, partly]


def test_dry_run_names_what_it_would_install_and_an_empty_folder_is_an_error(tmp_path, capsys):
    _wheel(tmp_path, "jsonish", ["json/__init__.py"], top_level=["json"])
    _wheel(tmp_path, "nowhere", ["qerl_no_such_module_xyz/__init__.py"])
    assert main([str(tmp_path), "--target", str(tmp_path / "site"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "installing 1 of 2 wheels" in out and "jsonish-1.0-py3-none-any.whl" in out.splitlines()[0]
    assert "  nowhere-1.0-py3-none-any.whl" in out and not (tmp_path / "site").exists()
    assert main([str(tmp_path), "--target", str(tmp_path / "site"), "--dry-run", "--all"]) == 0
    assert "installing 2 of 2 wheels" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "empty"), "--target", str(tmp_path / "site")])
    assert "folder=" in capsys.readouterr().err


def test_a_missing_wheel_is_really_installed_into_the_target(tmp_path):
    import subprocess
    import sys

    name = "qerl_carried_demo"
    (tmp_path / "wheels").mkdir()
    _wheel(tmp_path / "wheels", name, {f"{name}/__init__.py": "VALUE = 41 + 1\n"}, top_level=[name])
    site = tmp_path / "site"
    assert main([str(tmp_path / "wheels"), "--target", str(site)]) == 0
    got = subprocess.run([sys.executable, "-c", f"import {name}; print({name}.VALUE)"], capture_output=True,
                         text=True, env={"PYTHONPATH": str(site)})
    assert got.stdout.strip() == "42", got.stderr
