"""Distributed inference (lab 12): ranks, the communicator they talk through, and the given parts
of tensor parallelism, pipeline parallelism and prefill-decode disaggregation.

    from course.dist import launch, run_threads
    launch(fn, 3, *args)        # fn(comm, *args) in 3 processes (torch.distributed, gloo, CPU)
    run_threads(fn, 2, *args)   # the same in 2 threads of this process (tests: fast, nothing to clean up)
"""
from course.dist.comm import Comm, CommStats, CustomAllReduce, TorchComm, Work
from course.dist.launch import RankError, free_port, init_from_env, launch
from course.dist.threads import RankAborted, ThreadComm, run_threads

__all__ = ["Comm", "CommStats", "CustomAllReduce", "TorchComm", "ThreadComm", "Work", "RankError", "RankAborted", "free_port",
           "init_from_env", "launch", "run_threads"]
