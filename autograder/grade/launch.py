"""Start one sandboxed kernel: the `argv` of the grading kernelspec runs this file (stdlib only).

    python launch.py PLAN.json CONNECTION_FILE

PLAN.json (written by `autograder.grade.sandbox.Sandbox.write_kernelspec`) holds the resource
limits (soft, hard), the uid the kernel runs as, and the whole bubblewrap command with `{connection_file}` in
it. This file sets the limits on itself (they are inherited through `exec` by bwrap and the
kernel), lets the sandbox uid read the connection file that jupyter_client just wrote (mode 0600,
owned by the grader), then replaces itself with bwrap: no grader process stays in between.
It must not import the course or autograder (it runs before any of that is needed, and fast).
"""
import json
import os
import resource
import sys

LIMITS = {  # plan key -> rlimit
    "memory_bytes": resource.RLIMIT_AS,       # address space (no GPU)
    "data_bytes": resource.RLIMIT_DATA,       # private writable memory (with --gpu: see Sandbox.rlimits)
    "cpu_seconds": resource.RLIMIT_CPU,
    "processes": resource.RLIMIT_NPROC,
    "file_bytes": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
    "core_bytes": resource.RLIMIT_CORE,
}


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit(f"usage: {os.path.basename(__file__)} PLAN.json CONNECTION_FILE (got {argv})")
    plan_path, connection_file = argv
    with open(plan_path) as f:
        plan = json.load(f)
    uid = plan.get("uid")
    if uid is not None:  # the kernel drops to this uid inside the sandbox: it must read the file
        os.chown(connection_file, uid, uid)
    for key, (soft, hard) in plan["rlimits"].items():
        resource.setrlimit(LIMITS[key], (int(soft), int(hard)))
    command = [arg.replace("{connection_file}", connection_file) for arg in plan["command"]]
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
