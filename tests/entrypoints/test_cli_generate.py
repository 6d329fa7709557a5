"""`hybridkv generate` on a local checkpoint folder, and its error path."""
from hybridkv.entrypoints.cli import main


def test_generate_prints_each_prompt_and_its_completion(tiny_ckpt, capsys):
    path = tiny_ckpt("llama")
    assert main(["generate", "the quick brown", "a lighthouse", "--model", path, "--max-tokens", "4", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "### the quick brown" in out and "### a lighthouse" in out


def test_generate_chat_mode_uses_the_chat_template(tiny_ckpt, capsys):
    path = tiny_ckpt("llama")
    assert main(["generate", "hello", "--chat", "--model", path, "--max-tokens", "3"]) == 0
    assert "### hello" in capsys.readouterr().out


def test_unknown_model_folder_exits_2_with_a_message(tmp_path, capsys):
    assert main(["generate", "hi", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "missing" in err
