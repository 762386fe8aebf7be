"""The tests' own helpers where a verdict depends on them: a launch's check counts (tests/helpers/torchrun_util.py)
and a SLURM job's end in the accounting (tests/helpers/cluster.py)."""

import pytest


def test_a_launch_s_verdict_counts_its_checks_and_its_failures():
    """`every_check_passed` reads the count of checks and failures, not a substring: "10 failures" fails,
    and so does a run that made no check or printed no summary."""
    from tests.helpers.torchrun_util import every_check_passed

    assert every_check_passed("noise\n12 checks on rank 0, 0 failures over all ranks\n") == 12
    for output in ("12 checks on rank 0, 10 failures over all ranks", "0 checks on rank 0, 0 failures over all ranks",
                   "[rank 1] FAIL loss", "1 checks on rank 0, 0 failures over all ranks\n"
                                         "1 checks on rank 0, 0 failures over all ranks"):
        with pytest.raises(AssertionError):
            every_check_passed(output)


def test_a_job_s_end_is_read_from_the_accounting_with_its_restarts(tmp_path):
    """jobcomp/filetxt writes one record per end: a requeue (recorded as PENDING) counts as a restart, an array
    task is found by ARRAY_TASK too, and a job it never recorded has no end."""
    from tests.helpers.cluster import accounted_end

    path = tmp_path / "jobcomp.txt"
    path.write_text("JobId=7 Name=wrap JobState=PENDING NodeList=node2\n"
                    "JobId=8 Name=wrap JobState=COMPLETED ArrayJobId=5 ArrayTaskId=1 NodeList=node1\n"
                    "JobId=7 Name=wrap JobState=COMPLETED NodeList=node1 ExitCode=0:0\n")
    assert accounted_end(str(path), "7") == {"JobId": "7", "Name": "wrap", "JobState": "COMPLETED",
                                             "NodeList": "node1", "ExitCode": "0:0", "Restarts": "1"}
    assert accounted_end(str(path), "5_1")["JobState"] == "COMPLETED"
    assert accounted_end(str(path), "5_1")["Restarts"] == "0"
    assert accounted_end(str(path), "9") == {} and accounted_end(str(tmp_path / "none.txt"), "7") == {}
