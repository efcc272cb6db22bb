"""The demo's command line refuses bad --style-weights naming the flag, before any work starts."""

import pytest

from fastcov.trainer.demo import main


@pytest.mark.parametrize("weights", ["0.5,0.5", "1,1,1,x", "1,-1,1,1", "0,0,0,0"])
def test_bad_style_weights_are_refused_with_the_flag_named(weights, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "demo"), "--style-weights", weights])
    assert exc.value.code == 2
    assert "--style-weights" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()  # refused before writing the task
