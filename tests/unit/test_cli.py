"""`pdserve generate --local` prints the documented JSON contract; a Ray client command keeps stdout for its answer."""

from __future__ import annotations

import io
import json
import threading

from bench.cluster import write_config
from deploy.cli import main


def test_generate_local_json_raw(capsys, demo_model, hf_greedy, tmp_path):
    config = str(write_config(tmp_path / "pdserve.yaml"))  # dtype float32, as the HF reference
    assert main(["generate", "The capital of France is", "--local", "-c", config, "--raw", "--json", "--max-tokens", "8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompt_token_ids"] == demo_model.tokenizer("The capital of France is")["input_ids"]
    assert result["token_ids"] == hf_greedy(tuple(result["prompt_token_ids"]), 8)
    assert result["text"] == demo_model.tokenizer.decode(result["token_ids"], skip_special_tokens=True)


def test_generate_local_chat_template_and_bad_input(capsys, demo_model):
    assert main(["generate", "hi", "--local", "--json", "--max-tokens", "4"]) == 0
    result = json.loads(capsys.readouterr().out)
    chat = demo_model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert result["prompt_token_ids"] == demo_model.tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert main(["generate", "hi", "--local", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_ray_events_of_a_client_command_go_to_stderr_and_its_answer_to_stdout():
    from deploy.launcher import DriverStdout

    answers, events = io.StringIO(), io.StringIO()
    stdout = DriverStdout(answers=answers, events=events)
    ray_listener = threading.Thread(target=stdout.write, args=("(raylet) node died: raylet crashes unexpectedly\n",))
    ray_listener.start()
    ray_listener.join()
    print(json.dumps({"router": {}}), file=stdout)
    assert json.loads(answers.getvalue()) == {"router": {}}
    assert "raylet crashes" in events.getvalue()
