"""`vaswani-tx demo` (issue 30): the Gradio page served on 127.0.0.1 and called over HTTP with gradio_client and in
headless Chromium with Selenium; the Space `--write-space` writes, run without vaswani_tx; the command without
Gradio. Nothing but 127.0.0.1 is contacted: the tests' process refuses any other address, and Chromium resolves no
other name."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from vaswani_tx.cli import main as cli_main
from vaswani_tx.demo.demo import build_demo, serve, write_space
from vaswani_tx.engine.translation import load_translator

REPO = Path(__file__).resolve().parents[1]
SENTENCE = "Ein Hund läuft über die Wiese."
_spec = importlib.util.spec_from_file_location("demo_screenshot", REPO / "scripts" / "demo_screenshot.py")
browser_steps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(browser_steps)  # the README screenshot's Selenium steps, run here as a test

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # gradio_client reads it too: no telemetry from the tests
pytestmark = [  # Gradio's queue on pandas 3, not ours
    pytest.mark.filterwarnings("ignore:.*no_silent_downcasting"),
    pytest.mark.filterwarnings("ignore:The copy keyword is deprecated"),
]


@pytest.fixture(scope="module", autouse=True)
def loopback_only():
    """Any connection this process opens (gradio, gradio_client, transformers) to an address other than the
    loopback fails the module."""
    attempts = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def check(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1"):
            attempts.append(address)
            raise ConnectionRefusedError(f"the demo tests reach only 127.0.0.1, not {address}")

    def connect(sock, address):
        check(sock, address)
        return real_connect(sock, address)

    def connect_ex(sock, address):
        check(sock, address)
        return real_connect_ex(sock, address)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", connect)
        patch.setattr(socket.socket, "connect_ex", connect_ex)
        yield
    assert attempts == [], f"connections to other hosts than 127.0.0.1: {attempts}"


@pytest.fixture(scope="module")
def folder(tiny_translator):
    return tiny_translator[0]


@pytest.fixture(scope="module")
def translator(folder):
    return load_translator(folder, device="cpu")


@pytest.fixture(scope="module")
def url(folder):
    pytest.importorskip("gradio", reason="the demo needs Gradio: pip install -e '.[demo]'")
    page = serve(build_demo(folder, device="cpu"), "127.0.0.1", browser_steps.free_port(), block=False)
    try:
        yield page.local_url
    finally:
        page.close()


@pytest.fixture(scope="module")
def client(url):
    from gradio_client import Client

    client = Client(url, verbose=False, download_files=False)
    try:
        yield client
    finally:
        client.close()


def translate_command(folder, capsys, *options: str) -> str:
    assert cli_main(["translate", str(folder), SENTENCE, "--quiet", "--device", "cpu", *options]) == 0
    return capsys.readouterr().out.removesuffix("\n")


def test_translate_endpoint_gives_what_the_translate_command_gives(client, folder, capsys):
    assert client.predict(SENTENCE, api_name="/translate") == translate_command(folder, capsys)
    assert client.predict(SENTENCE, 2, 1.5, api_name="/translate") == translate_command(
        folder, capsys, "--num-beams", "2", "--length-penalty", "1.5"
    )


def test_attention_is_that_of_the_translation_with_the_tokens_on_its_axes(client, translator):
    result = client.predict(SENTENCE, api_name="/attention")
    tokenizer, config = translator.tokenizer, translator.model.config
    assert result["translation"] == translator.translate([SENTENCE])[0]
    source = tokenizer.convert_ids_to_tokens(tokenizer(SENTENCE)["input_ids"])
    target = result["target_tokens"]
    assert result["source_tokens"] == source and target[0] == tokenizer.bos_token
    # teacher-forced on the tokens generate() produced: they decode to the translation
    decoded = tokenizer.decode(tokenizer.convert_tokens_to_ids(target), skip_special_tokens=True)
    assert decoded.strip() == result["translation"]
    layers, heads = config.num_encoder_layers, config.num_heads
    shapes = {
        "encoder": (layers, heads, len(source), len(source)),
        "decoder": (layers, heads, len(target), len(target)),
        "cross": (layers, heads, len(target), len(source)),
    }
    for kind, shape in shapes.items():
        weights = np.array(result[kind])
        assert weights.shape == shape, kind
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-3)
    assert np.abs(np.triu(np.array(result["decoder"]), k=1)).max() == 0  # no look at later target tokens


def test_bad_input_is_a_message_and_the_server_keeps_serving(client, translator):
    from gradio_client.exceptions import AppError

    for text, message in [("", "empty"), ("   \n ", "only spaces"), ("Hund " * 1100, "1024 positions")]:
        with pytest.raises(AppError, match=message):
            client.predict(text, api_name="/translate")
    with pytest.raises(AppError, match="beam size"):
        client.predict(SENTENCE, 3.5, 0.6, api_name="/attention")
    outside = client.predict("Ein Жук läuft. 😀", api_name="/attention")  # translated, with a note naming them
    assert outside["translation"] and outside["notes"] == ["not in the vocabulary, read as bytes: Ж у к 😀"]
    assert client.predict(SENTENCE, api_name="/translate") == translator.translate([SENTENCE])[0]


def test_eight_requests_at_once_are_each_answered_with_their_own_translation(client, translator, shared_data):
    texts = (shared_data / "multi30k-en-de" / "val.de").read_text(encoding="utf-8").splitlines()[:8]
    expected = translator.translate(texts)
    assert len(set(expected)) == 8  # so that a mix-up could not go unseen
    jobs = [client.submit(text, api_name="/translate") for text in texts]
    assert [job.result(timeout=120) for job in jobs] == expected


def test_the_page_in_headless_chromium(url, translator, tmp_path):
    if browser_steps.chromium() is None:
        pytest.skip(
            "Chromium or its driver is missing (apt-get install chromium chromium-driver; scripts/test.sh "
            "installs them in CI)"
        )
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def wait(driver):  # Gradio replaces the elements it updates: one found a moment ago may be gone, look again
        return WebDriverWait(driver, 30, ignored_exceptions=(StaleElementReferenceException,))

    driver = browser_steps.open_browser()
    try:
        shown = browser_steps.translate_on_page(driver, url, SENTENCE)
        assert shown == translator.translate([SENTENCE])[0]
        browser_steps.open_attention(driver)
        labels = driver.find_element(By.CSS_SELECTOR, "#attention").text
        assert "encoder-decoder attention" in labels and "Layer" in labels and "Head" in labels
        assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#head label")] == ["1", "2", "3"]
        heatmap = driver.find_element(By.CSS_SELECTOR, "#heatmap img").get_attribute("src")
        driver.find_element(By.XPATH, "//label[contains(., 'encoder self-attention')]").click()  # another map
        wait(driver).until(lambda d: d.find_element(By.CSS_SELECTOR, "#heatmap img").get_attribute("src") != heatmap)
        screenshot = browser_steps.save_screenshot(driver, tmp_path / "demo.png")
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 20_000
        source = driver.find_element(By.CSS_SELECTOR, "#source textarea")
        source.clear()
        source.send_keys("   ")
        driver.find_element(By.CSS_SELECTOR, "#translate").click()
        wait(driver).until(
            lambda d: any("only spaces" in e.text for e in d.find_elements(By.CSS_SELECTOR, ".toast-body"))
        )
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def one_head_folder(tiny_translator, tmp_path_factory):
    """A model of one head, one encoder layer and two decoder layers, with the 500-token vocabulary."""
    import torch

    from vaswani_tx import VaswaniConfig, VaswaniForConditionalGeneration

    tokenizer = tiny_translator[2]
    torch.manual_seed(0)
    config = VaswaniConfig(
        vocab_size=len(tokenizer), d_model=12, num_heads=1, d_ff=20, num_encoder_layers=1, num_decoder_layers=2
    )
    folder = tmp_path_factory.mktemp("one-head")
    VaswaniForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_one_layer_one_head_int8_in_headless_chromium(one_head_folder, tmp_path):
    """The layer and head controls offer what the model has: one head, one encoder layer, two decoder layers (a
    slider from 1 to 1 stopped the page from being built); the int8 page translates as `translate --int8`."""
    if browser_steps.chromium() is None:
        pytest.skip("Chromium or its driver is missing (apt-get install chromium chromium-driver)")
    pytest.importorskip("gradio", reason="the demo needs Gradio: pip install -e '.[demo]'")
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def choices(driver, control: str) -> list[str]:
        return [e.text for e in driver.find_elements(By.CSS_SELECTOR, f"#{control} label") if e.text]

    expected = load_translator(one_head_folder, device="cpu", int8=True).translate([SENTENCE])[0]
    page = serve(
        build_demo(one_head_folder, device="cpu", int8=True), "127.0.0.1", browser_steps.free_port(), block=False
    )
    driver = browser_steps.open_browser()
    try:
        assert browser_steps.translate_on_page(driver, page.local_url, SENTENCE) == expected
        browser_steps.open_attention(driver)
        assert choices(driver, "head") == ["1"]
        assert choices(driver, "layer") == ["1", "2"]  # encoder-decoder attention: the decoder's two layers
        driver.find_element(By.XPATH, "//label[contains(., 'encoder self-attention')]").click()
        wait = WebDriverWait(driver, 30, ignored_exceptions=(StaleElementReferenceException,))
        wait.until(lambda d: choices(d, "layer") == ["1"])  # the encoder's one layer, shown as one choice
        browser_steps.save_screenshot(driver, tmp_path / "one-head.png")
    finally:
        driver.quit()
        page.close()


def test_converted_model_without_decoding_settings_is_served(tmp_path):
    """A converted Marian folder whose generation config sets no beam size or length penalty (OPUS-MT's case):
    the page's controls show transformers' defaults, beam 1 and alpha 1.0."""
    pytest.importorskip("gradio", reason="the demo needs Gradio: pip install -e '.[demo]'")
    from test_convert import EN, _marian_folder
    from test_generation_defaults import unset_decoding
    from vaswani_tx.demo.demo import DemoPage, translator_function
    from vaswani_tx.interop.convert import convert

    _marian_folder(tmp_path / "marian", share=True, activation="relu")
    unset_decoding(tmp_path / "marian")
    convert(tmp_path / "marian", tmp_path / "converted")
    translator = load_translator(tmp_path / "converted", device="cpu")
    page = DemoPage(translator.model, translator.tokenizer, translator_function(translator), "converted")
    page.blocks()
    assert "beam 1, length penalty 1.0" in page.summary()
    analysis = page.analyse(EN[0])
    assert analysis.translation == translator.translate([EN[0]])[0] and analysis.settings.startswith("beam 1, ")


def test_the_space_serves_the_page_without_vaswani_tx(folder, translator, tmp_path):
    import gradio
    import yaml
    from gradio_client import Client

    space = tmp_path / "space"
    written = write_space(space, str(folder), model_dir=folder)  # a folder where the hub repo id would be
    assert {p.relative_to(space).as_posix() for p in written} >= {"app.py", "requirements.txt", "README.md"}
    meta = yaml.safe_load((space / "README.md").read_text(encoding="utf-8").split("---\n")[1])
    assert meta["sdk"] == "gradio" and meta["sdk_version"] == gradio.__version__ and meta["app_file"] == "app.py"
    assert meta["models"] == [str(folder)]
    requirements = (space / "requirements.txt").read_text(encoding="utf-8")
    assert "transformers" in requirements and "vaswani" not in requirements
    shadow = tmp_path / "no-vaswani-tx" / "vaswani_tx"  # in front of the installed package: importing it fails
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the Space imported vaswani_tx')\n", encoding="utf-8")
    port = browser_steps.free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(shadow.parent),
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }
    log = tmp_path / "space.log"
    with log.open("wb") as out:
        app = subprocess.Popen(
            [sys.executable, "app.py"], cwd=space, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 90
        while app.poll() is None and time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.5)
        assert app.poll() is None, log.read_text(errors="replace")[-3000:]
        client = Client(f"http://127.0.0.1:{port}/", verbose=False, download_files=False)
        try:
            assert client.predict(SENTENCE, api_name="/translate") == translator.translate([SENTENCE])[0]
            assert np.array(client.predict(SENTENCE, api_name="/attention")["cross"]).shape[:2] == (2, 3)
        finally:
            client.close()
    finally:
        app.terminate()
        try:
            app.wait(timeout=15)
        except subprocess.TimeoutExpired:
            app.kill()
            app.wait()


def test_the_command_without_gradio_says_how_to_install_it(folder, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gradio", None)  # `import gradio` raises ImportError
    assert cli_main(["demo", str(folder)]) == 2
    assert "pip install -e '.[demo]'" in capsys.readouterr().err


def test_the_command_writes_a_space_and_checks_its_arguments(folder, tmp_path, capsys):
    pytest.importorskip("gradio", reason="the demo needs Gradio: pip install -e '.[demo]'")
    space = tmp_path / "space"
    assert cli_main(["demo", str(folder), "--write-space", str(space), "--repo-id", "someone/tiny-de-en"]) == 0
    assert "someone/tiny-de-en" in (space / "app.py").read_text(encoding="utf-8")
    assert (space / "vaswani_demo" / "demo.py").is_file()
    capsys.readouterr()
    for arguments, message in [
        (["--write-space", str(space), "--repo-id", "someone/tiny-de-en"], "already exists"),
        (["--write-space", str(tmp_path / "other")], "needs --repo-id USER/NAME"),
        (["--write-space", str(tmp_path / "other"), "--repo-id", "not a repo"], "needs --repo-id USER/NAME"),
        (["--repo-id", "someone/tiny-de-en"], "go with --write-space"),
        (["--port", "70000"], "--port must be from 1 to 65535"),
    ]:
        assert cli_main(["demo", str(folder), *arguments]) == 2, arguments
        assert message in capsys.readouterr().err, arguments
    assert not (tmp_path / "other").exists()
    with socket.socket() as taken:  # a port in use: said before the model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert cli_main(["demo", str(folder), "--port", str(taken.getsockname()[1])]) == 2
    assert "Address already in use): give another --port" in capsys.readouterr().err


def test_the_model_card_links_the_space(tiny_translator):
    from vaswani_tx.interop.publishing import render_model_card

    card = dict(repo="someone/tiny-de-en", source_lang="de", target_lang="en", training_data="Multi30k val.")
    linked = render_model_card(tiny_translator[1], **card, space="someone/tiny-de-en-demo")
    assert "[someone/tiny-de-en-demo](https://huggingface.co/spaces/someone/tiny-de-en-demo)" in linked
    assert "huggingface.co/spaces" not in render_model_card(tiny_translator[1], **card)
