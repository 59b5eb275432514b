"""The C event structs and their numpy mirrors must agree byte for byte."""

import shutil
import subprocess

import pytest

from watcher.bpf import events

from .conftest import ROOT

PROGRAM = r"""
#include <stdio.h>
#include <stddef.h>
#include "events.h"
int main(void) {
    printf("syscall %zu\n", sizeof(struct syscall_event));
    printf("futex %zu\n", sizeof(struct futex_event));
    printf("proc %zu\n", sizeof(struct proc_event));
    printf("signal %zu\n", sizeof(struct signal_event));
    printf("api %zu\n", sizeof(struct api_event));
    printf("file %zu\n", sizeof(struct file_event));
    printf("file.path %zu\n", offsetof(struct file_event, path));
    printf("pystack %zu\n", sizeof(struct py_stack_event));
    printf("pystack.instr %zu\n", offsetof(struct py_stack_event, instr));
    printf("proc.argv %zu\n", offsetof(struct proc_event, argv));
    printf("futex.wake_ts %zu\n", offsetof(struct futex_event, wake_ts));
    printf("syscall.nr %zu\n", offsetof(struct syscall_event, nr));
    printf("api.tensor %zu\n", offsetof(struct api_event, tensor));
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_struct_sizes_and_offsets_match(tmp_path):
    src = tmp_path / "sizes.c"
    src.write_text(PROGRAM)
    exe = tmp_path / "sizes"
    subprocess.run(["cc", "-I", str(ROOT / "bpf"), "-o", str(exe), str(src)], check=True)
    out = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                          check=True).stdout.splitlines())
    for name, dtype in events.EVENT_DTYPES.items():
        assert int(out[name]) == dtype.itemsize, name
        assert dtype.itemsize % 8 == 0, name
    assert int(out["proc.argv"]) == events.PROC_EVENT.fields["argv"][1]
    assert int(out["futex.wake_ts"]) == events.FUTEX_EVENT.fields["wake_ts"][1]
    assert int(out["syscall.nr"]) == events.SYSCALL_EVENT.fields["nr"][1]
    assert int(out["api.tensor"]) == events.API_EVENT.fields["tensor"][1]
    assert int(out["file.path"]) == events.FILE_EVENT.fields["path"][1]
    assert int(out["pystack.instr"]) == events.PY_STACK_EVENT.fields["instr"][1]
