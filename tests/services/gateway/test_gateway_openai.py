"""The OpenAI-compatible endpoints through the official `openai` client, against the gateway
over a real inference service and store: the same greedy outputs as the gRPC API for the same
requests, chat prompts rendered as Hugging Face renders them, n choices with derived seeds,
stop strings, usage, streaming, and the error bodies and status codes."""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest
from transformers import AutoTokenizer

from lorafleet.v1 import inference_pb2 as pb
from tests.services.inference.stack import collect, sampling

PROMPTS = ["The quick brown fox", "Héllo wörld, ça va? 日本語", "def fibonacci(n):"]
FINISH = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop",
          pb.FINISH_REASON_EOS: "stop"}  # fmt: skip
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Where is the harbour?"},
]


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    with openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0) as c:
        yield c


def grpc_generate(stack, adapter="", seed=None, **fields) -> tuple[str, str, pb.Usage]:
    params = sampling(**{k: v for k, v in fields.items() if k not in ("prompt", "ids")})
    if seed is not None:
        params.seed = seed
    request = pb.GenerateRequest(adapter_id=adapter, sampling=params)
    if "ids" in fields:
        request.prompt_token_ids.extend(fields["ids"])
    else:
        request.prompt = fields["prompt"]
    stream = collect(stack.stub, request)
    assert stream.details == "", stream.details
    return stream.text, FINISH[stream.last.finish_reason], stream.last.usage


@pytest.mark.parametrize("model,adapter", [("tiny-llama", ""), ("a", "a"), ("b", "b")])
def test_completions_equal_the_grpc_api_streamed_or_not(stack, client, model, adapter):
    for prompt in PROMPTS:
        text, finish, usage = grpc_generate(
            stack, adapter, prompt=prompt, max_new_tokens=12, temperature=0
        )
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert whole.model == model and whole.object == "text_completion"
        assert whole.choices[0].text == text and whole.choices[0].finish_reason == finish
        assert whole.usage.prompt_tokens == usage.prompt_tokens
        assert whole.usage.completion_tokens == usage.completion_tokens
        assert whole.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        chunks = list(
            client.completions.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == text
        assert [c.choices[0].finish_reason for c in chunks][-1] == finish
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
        assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")


def test_token_id_prompts_and_prompt_lists_index_choices_prompt_by_prompt(stack, client):
    ids = [[0, 85, 91, 266, 482], [0, 36, 71]]
    expect = [grpc_generate(stack, "a", ids=i, max_new_tokens=6, temperature=0) for i in ids]
    out = client.completions.create(model="a", prompt=ids, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [expect[0][0]] * 2 + [expect[1][0]] * 2
    # Prompt tokens count each prompt once (OpenAI's rule), completions every choice.
    assert out.usage.prompt_tokens == expect[0][2].prompt_tokens + expect[1][2].prompt_tokens
    assert out.usage.completion_tokens == 2 * (
        expect[0][2].completion_tokens + expect[1][2].completion_tokens
    )
    texts = [grpc_generate(stack, "", prompt=p, max_new_tokens=5, temperature=0)[0]
             for p in PROMPTS]  # fmt: skip
    out = client.completions.create(model="tiny-llama", prompt=PROMPTS, max_tokens=5,
                                    temperature=0)  # fmt: skip
    assert [c.text for c in out.choices] == texts


def test_chat_renders_the_template_as_hugging_face_does(stack, client, gw_models):
    hf = AutoTokenizer.from_pretrained(gw_models.model)
    ids = list(hf.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"])
    text, finish, usage = grpc_generate(stack, "b", ids=ids, max_new_tokens=10, temperature=0)
    whole = client.chat.completions.create(
        model="b", messages=CHAT, max_completion_tokens=10, temperature=0
    )
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text
    assert whole.choices[0].finish_reason == finish
    assert whole.usage.prompt_tokens == len(ids) == usage.prompt_tokens  # one BOS, not two
    chunks = list(
        client.chat.completions.create(
            model="b",
            messages=CHAT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    # Content given as text parts renders the same prompt.
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    again = client.chat.completions.create(model="b", messages=parts, max_tokens=10, temperature=0)
    assert again.choices[0].message.content == text


def test_n_choices_take_seed_plus_index_and_stream_interleaved(stack, client):
    expect = [
        grpc_generate(stack, "a", seed=7 + i, prompt=PROMPTS[0], max_new_tokens=8,
                      temperature=1.0, ignore_eos=True)[0]
        for i in range(3)
    ]  # fmt: skip
    assert len(set(expect)) > 1  # sampled: the seeds give different texts
    out = client.completions.create(
        model="a", prompt=PROMPTS[0], max_tokens=8, n=3, seed=7, extra_body={"ignore_eos": True}
    )  # temperature defaults to 1, as OpenAI's
    assert [c.text for c in out.choices] == expect
    texts = ["", "", ""]
    for chunk in client.completions.create(
        model="a", prompt=PROMPTS[0], max_tokens=8, n=3, seed=7, stream=True,
        extra_body={"ignore_eos": True},
    ):  # fmt: skip
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expect
    chat = client.chat.completions.create(
        model="a", messages=CHAT, max_tokens=6, n=2, seed=7, temperature=1.0
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_stop_strings_end_the_choice_before_them(stack, client):
    text, _, _ = grpc_generate(stack, "", prompt=PROMPTS[2], max_new_tokens=24, temperature=0,
                               ignore_eos=True)  # fmt: skip
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    out = client.completions.create(
        model="tiny-llama", prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=stop,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]
    listed = client.completions.create(
        model="tiny-llama", prompt=PROMPTS[2], max_tokens=24, temperature=0,
        stop=["\u2603 never", stop], extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert listed.choices[0].text == out.choices[0].text


def grpc_logprobs(stack, adapter: str, ids: list[int], n: int, k: int) -> list:
    request = pb.GenerateRequest(adapter_id=adapter, prompt_token_ids=ids,
                                 sampling=sampling(max_new_tokens=n, logprobs=k))  # fmt: skip
    stream = collect(stack.stub, request)
    assert stream.details == "", stream.details
    return [lp for m in stream.messages for lp in m.logprobs]


def test_completion_logprobs_equal_the_grpc_api(stack, client):
    """Each token's log-probability and its alternatives, as the engine gives them over gRPC,
    in OpenAI's legacy shape; streamed, the chunks' logprobs add up to the same lists."""
    ids = [5, 9, 13, 17, 21]
    want = grpc_logprobs(stack, "a", ids, 6, 2)
    whole = client.completions.create(model="a", prompt=ids, max_tokens=6, temperature=0,
                                      logprobs=2)  # fmt: skip
    lp = whole.choices[0].logprobs
    assert lp.tokens == [e.token for e in want]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want])
    assert [list(d) for d in lp.top_logprobs] == [[t.token for t in e.top] for e in want]
    assert lp.text_offset == [sum(len(e.token) for e in want[:i]) for i in range(len(want))]
    chunks = list(client.completions.create(model="a", prompt=ids, max_tokens=6, temperature=0,
                                            logprobs=2, stream=True))  # fmt: skip
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert streamed == lp.tokens
    plain = client.completions.create(model="a", prompt=ids, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_logprobs_carry_tokens_bytes_and_alternatives(stack, client):
    args = dict(model="tiny-llama", messages=CHAT, max_tokens=5, temperature=0, logprobs=True)
    whole = client.chat.completions.create(**args, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best one
    only = client.chat.completions.create(**args)
    assert [e.top_logprobs for e in only.choices[0].logprobs.content] == [[]] * 5


def test_models_lists_the_base_model_first_then_the_adapters(client):
    models = client.models.list().data
    assert [m.id for m in models][:1] == ["tiny-llama"]
    assert {"a", "b"} <= {m.id for m in models[1:]}
    assert client.models.retrieve("a").id == "a"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no/such")


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        (dict(model="no-such-adapter"), openai.NotFoundError, "no-such-adapter"),
        (dict(logprobs=21), openai.BadRequestError, "logprobs must be an integer from 0 to 20"),
        (dict(n=17), openai.BadRequestError, "--max-n"),
        (dict(max_tokens=5000), openai.BadRequestError, "context window"),
        (dict(temperature=-1), openai.BadRequestError, "temperature"),
        (dict(presence_penalty=1.0), openai.BadRequestError, "presence_penalty"),
        (dict(model="no-such-adapter", stream=True), openai.NotFoundError, "no-such-adapter"),
    ],
)
def test_errors_carry_openai_bodies_and_status_codes(client, kwargs, error, fragment):
    args = dict(model="tiny-llama", prompt="hello", max_tokens=4) | kwargs
    with pytest.raises(error) as caught:
        result = client.completions.create(**args)
        list(result) if args.get("stream") else None
    assert fragment in caught.value.message
    body = caught.value.body
    assert body["code"] == caught.value.status_code and body["type"].endswith("error")


def test_chat_errors(client, stack):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="a", messages=[{"role": "wizard", "content": "x"}], max_tokens=2
        )
    assert "roles must be system, user or assistant" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="a", messages=CHAT, top_logprobs=2)
    assert "top_logprobs needs logprobs: true" in caught.value.message
    bad = httpx.post(stack.url("/v1/chat/completions"), content=b"{not json", timeout=10)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    wrong = httpx.post(stack.url("/v1/completions"), json={"model": "a"}, timeout=10)
    assert wrong.status_code == 400 and "prompt" in wrong.json()["error"]["message"]
    big = httpx.post(stack.url("/v1/completions"), content=b" " * (9 << 20), timeout=10)
    assert big.status_code == 413
