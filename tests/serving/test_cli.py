"""`setdiff serve`'s argument checks: one line and exit code 2, before any model loads."""

import pytest

from setdiff_megatron.cli import main


@pytest.mark.parametrize("port", ["99999", "0", "-1", "65536"])
def test_a_port_outside_1_to_65535_is_one_line_before_the_model_loads(tmp_path, capsys, port):
    assert main(["serve", str(tmp_path / "no-run-here"), "--port", port]) == 2
    err = capsys.readouterr().err
    assert err == f"setdiff: error: --port must be in 1..65535; got {port}\n"
