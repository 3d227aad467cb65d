"""What a run attached to a cluster ships (miles.cluster.shipping), and how an actor finds the shipped
copy of a user's file (miles.user_code) where the driver's path does not exist."""

from __future__ import annotations

import json

import pytest

from miles.cluster import shipping
from miles.cluster.shipping import USER_FILES_DIR, miles_package, stage
from miles.config import ConfigError
from miles.user_code import USER_FILES_ENV, display_name, import_user_function


def write(path, text="def fn(*args):\n    return 1.0\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_files_given_by_path_are_copied_once_each_and_mapped_as_written(tmp_path):
    write(tmp_path / "driver" / "reward.py")
    write(tmp_path / "elsewhere" / "reward.py", "def keep(group):\n    return True\n")
    paths = {"--custom-rm-path": "reward.py:fn", "--custom-loss-function-path": "reward.py:fn",
             "--dynamic-sampling-filter-path": f"{tmp_path / 'elsewhere' / 'reward.py'}:keep"}
    shipment = stage(paths, tmp_path / "run" / "shipped", cwd=tmp_path / "driver")
    # two different files of one name: two copies; one file named by two flags: one copy
    assert shipment.files == {"reward.py": f"{USER_FILES_DIR}/0/reward.py",
                              str(tmp_path / "elsewhere" / "reward.py"): f"{USER_FILES_DIR}/1/reward.py"}
    assert (shipment.folder / USER_FILES_DIR / "1" / "reward.py").read_text().startswith("def keep")
    env = shipment.runtime_env()
    assert env["working_dir"] == str(tmp_path / "run" / "shipped") and env["py_modules"] == []
    assert json.loads(env["env_vars"][USER_FILES_ENV]) == shipment.files
    assert ".git" in env["excludes"] and ".venv" in env["excludes"] and "*.safetensors" in env["excludes"]


def test_a_user_package_given_by_module_is_copied_without_caches_vcs_or_weights(tmp_path, monkeypatch):
    pkg = tmp_path / "src" / "my_rewards"
    write(pkg / "__init__.py", "")
    write(pkg / "math.py")
    write(pkg / ".git" / "HEAD", "ref")
    write(pkg / "__pycache__" / "math.cpython-311.pyc", "x")
    write(pkg / "table.json", "{}")                           # data beside the code travels with it
    (pkg / "model.safetensors").write_bytes(b"\0" * 1000)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    shipment = stage({"--custom-rm-path": "my_rewards.math:fn", "--custom-tis-function-path": "json:loads",
                      "--custom-loss-function-path": "miles.algorithms:policy_loss"},
                     tmp_path / "shipped", code=[miles_package()])
    # json is the standard library's and miles travels as py_modules: neither is copied
    assert shipment.modules == ("my_rewards",) and shipment.files == {}
    copied = sorted(p.relative_to(shipment.folder).as_posix() for p in shipment.folder.rglob("*") if p.is_file())
    assert copied == ["my_rewards/__init__.py", "my_rewards/math.py", "my_rewards/table.json"]
    assert shipment.code == (str(miles_package()),) and shipment.runtime_env()["py_modules"] == [str(miles_package())]


def test_a_single_file_module_is_copied_and_an_installed_one_is_not(tmp_path, monkeypatch):
    write(tmp_path / "src" / "plain_reward.py")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    shipment = stage({"--custom-rm-path": "plain_reward:fn", "--custom-loss-function-path": "yaml:safe_load"},
                     tmp_path / "shipped")
    assert shipment.modules == ("plain_reward",)
    assert (shipment.folder / "plain_reward.py").is_file() and not (shipment.folder / "yaml").exists()


def test_a_shipment_too_big_is_refused_naming_its_biggest_file(tmp_path, monkeypatch):
    pkg = tmp_path / "src" / "bulky"
    write(pkg / "__init__.py", "")
    (pkg / "lookup.json").write_bytes(b"1" * 5000)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setattr(shipping, "MAX_SHIPPED_BYTES", 4000)
    with pytest.raises(ConfigError) as e:
        stage({"--custom-rm-path": "bulky:fn"}, tmp_path / "shipped")
    assert "lookup.json" in str(e.value) and "--ray-no-ship-code" in str(e.value)


def test_staging_again_replaces_the_previous_folder(tmp_path):
    write(tmp_path / "a.py")
    write(tmp_path / "b.py")
    stage({"--custom-rm-path": "a.py:fn"}, tmp_path / "shipped", cwd=tmp_path)
    shipment = stage({"--custom-rm-path": "b.py:fn"}, tmp_path / "shipped", cwd=tmp_path)
    assert [p.name for p in shipment.folder.rglob("*.py")] == ["b.py"]


def test_an_actor_imports_the_shipped_copy_where_the_drivers_path_does_not_exist(tmp_path, monkeypatch):
    # the driver's folder, then what an actor on another node sees: only the shipped folder, as its cwd
    driver = tmp_path / "driver"
    write(driver / "reward.py", "def score(prompt, response, label):\n    return 2.5\n")
    shipment = stage({"--custom-rm-path": "reward.py:score"}, tmp_path / "shipped", cwd=driver)
    (driver / "reward.py").unlink()
    node = tmp_path / "node"
    node.mkdir()
    monkeypatch.chdir(node)
    monkeypatch.delenv("MILES_DRIVER_CWD", raising=False)
    with pytest.raises(ConfigError, match="no such file"):       # not shipped: nothing at the driver's path
        import_user_function("reward.py:score", "--custom-rm-path")
    monkeypatch.chdir(shipment.folder)                           # Ray's working_dir
    monkeypatch.setenv(USER_FILES_ENV, shipment.runtime_env()["env_vars"][USER_FILES_ENV])
    fn = import_user_function("reward.py:score", "--custom-rm-path")
    assert fn(None, None, None) == 2.5
    assert display_name(fn) == "reward.py:score"                 # errors name it as the user wrote it
    assert fn.__code__.co_filename.startswith(str(shipment.folder))
