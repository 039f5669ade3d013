#!/usr/bin/python3
"""Python client for hmoe-gpu-worker (hmoe.api.v1.Generation).

Uses Debian's python3-grpcio and python3-protobuf and the stubs the build
generates from proto/api.proto into BUILD_DIR/python (HMOE_PYTHON_STUBS
overrides the location).

    from hmoe_client import Client
    c = Client("127.0.0.1:50051")
    for chunk in c.generate_stream("Love is", max_tokens=20):
        print(chunk.text, end="", flush=True)
    print(c.generate("Love is", max_tokens=20, temperature=0.8, seed=1).text)

Command line:
    /usr/bin/python3 sdk/python/hmoe_client.py --server ADDR generate "prompt" [--max-tokens N]
    /usr/bin/python3 sdk/python/hmoe_client.py --server ADDR info | stats | tokenize TEXT
"""
import argparse
import os
import stat
import sys
import time
from dataclasses import dataclass, field

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.environ.get("HMOE_PYTHON_STUBS", os.path.join(_HERE, "..", "..", "build", "python")))

try:
    import grpc  # noqa: E402
    from proto import api_pb2, api_pb2_grpc  # noqa: E402
    from proto.grpc.health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
except ImportError as e:
    sys.exit(f"hmoe_client: {e}: needs Debian's python3-grpcio and the generated stubs "
             "(cmake --build build --target hmoe_python_stubs, or set HMOE_PYTHON_STUBS to "
             "their directory)")

# As the C++ client (sdk/client.cc): answers up to 64 MiB (a long Detokenize).
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20)]

_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed")


@dataclass
class Result:
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: dict = field(default_factory=dict)


class Client:
    def __init__(self, target="127.0.0.1:50051", connect_timeout=10.0, token=None, tls_ca=None,
                 tls_cert=None, tls_key=None, tls=False):
        """token: the worker's --auth-token-file contents (read_token_file), or None.
        TLS (the worker's --tls-cert-file) when tls or any tls_* is given: tls_ca the CA's PEM bytes
        (None: gRPC's bundled roots), tls_cert / tls_key a client certificate for mutual TLS."""
        self._md = (("authorization", "Bearer " + token),) if token else None
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("a client certificate needs its key: tls_cert and tls_key go together "
                             "(--tls-cert-file and --tls-key-file)")
        if tls or tls_ca or tls_cert or tls_key:
            creds = grpc.ssl_channel_credentials(root_certificates=tls_ca, private_key=tls_key,
                                                 certificate_chain=tls_cert)
            self._channel = grpc.secure_channel(target, creds, options=_CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
        grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
        self._stub = api_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _request(self, prompt, max_tokens, stop, stop_token_ids, ignore_eos, add_special_tokens, **sampling):
        req = api_pb2.GenerateRequest(max_tokens=max_tokens, ignore_eos=ignore_eos,
                                      add_special_tokens=add_special_tokens)
        # Text fields are UTF-8 bytes on the wire (api.proto).
        if isinstance(prompt, (str, bytes)):
            req.prompt = prompt.encode("utf-8") if isinstance(prompt, str) else prompt
        else:
            req.prompt_ids.ids.extend(prompt)
        if isinstance(stop, (str, bytes)):
            stop = [stop]
        req.stop.extend(s.encode("utf-8") if isinstance(s, str) else s for s in stop or [])
        req.stop_token_ids.extend(stop_token_ids or [])
        for k, v in sampling.items():
            if k not in _SAMPLING:
                raise TypeError(f"unknown sampling parameter {k!r}")
            if v is not None:
                setattr(req.sampling, k, v)
        return req

    def generate_stream(self, prompt, max_tokens=64, stop=None, stop_token_ids=None, ignore_eos=False,
                        add_special_tokens=False, timeout=None, **sampling):
        """Yields GenerateResponse chunks; raises grpc.RpcError on failure."""
        req = self._request(prompt, max_tokens, stop, stop_token_ids, ignore_eos, add_special_tokens, **sampling)
        yield from self._stub.Generate(req, timeout=timeout, metadata=self._md)

    def generate(self, prompt, **kwargs):
        r = Result()
        for chunk in self.generate_stream(prompt, **kwargs):
            r.text += chunk.text
            r.token_ids.extend(chunk.token_ids)
            if chunk.finish_reason:
                r.finish_reason = api_pb2.FinishReason.Name(chunk.finish_reason)
                r.prompt_tokens = chunk.usage.prompt_tokens
                r.completion_tokens = chunk.usage.completion_tokens
                t = chunk.timings
                r.timings = {"queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms, "decode_ms": t.decode_ms,
                             "time_to_first_token_ms": t.time_to_first_token_ms, "total_ms": t.total_ms}
        return r

    def tokenize(self, text, add_special_tokens=False):
        if isinstance(text, str):
            text = text.encode("utf-8")
        return list(self._stub.Tokenize(api_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens),
                                        metadata=self._md).ids)

    def detokenize(self, ids, skip_special_tokens=False):
        return self._stub.Detokenize(api_pb2.DetokenizeRequest(ids=ids, skip_special_tokens=skip_special_tokens),
                                     metadata=self._md).text

    def model_info(self):
        return self._stub.ModelInfo(api_pb2.ModelInfoRequest(), metadata=self._md)

    def stats(self):
        return self._stub.Stats(api_pb2.StatsRequest(), metadata=self._md)

    def healthy(self):
        r = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        return r.status == health_pb2.HealthCheckResponse.SERVING


def read_token_file(path):
    """The token a client sends from `path`, checked as the C++ side checks it (common/auth_token.h):
    a regular file only its owner may access (symlinks followed), one token per line (at most 8;
    blank lines skipped; the first one is sent), each 16-4096 printable ASCII bytes without spaces
    after its line's trailing whitespace is dropped."""
    limit = 8 * (4096 + 2)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"auth token file {path}: not a regular file")
        if st.st_size > limit:
            raise ValueError(f"auth token file {path}: {st.st_size} bytes, over the {limit} taken")
        if st.st_mode & 0o077:
            raise PermissionError(f"auth token file {path}: mode {st.st_mode & 0o7777:04o} lets other users at "
                                  "the token; chmod 600 it")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    lines = [(n, l.rstrip(b" \t\r")) for n, l in enumerate(data.split(b"\n"), 1)]
    lines = [(n, l) for n, l in lines if l] or [(1, b"")]
    if len(lines) > 8:
        raise ValueError(f"auth token file {path}: {len(lines)} tokens, over the 8")
    for n, token in lines:
        what = f"auth token file {path}" + (f": line {n}" if len(lines) > 1 else "")
        if len(token) > 4096:
            raise ValueError(f"{what}: token over 4096 bytes")
        for i, c in enumerate(token):
            if c < 0x21 or c > 0x7e:
                raise ValueError(f"{what}: byte {i} is 0x{c:02x}; a token is printable ASCII without spaces")
        if len(token) < 16:
            raise ValueError(f"{what}: token of {len(token)} bytes; at least 16")
    return lines[0][1].decode("ascii")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", default=os.environ.get("HMOE_SERVER", "127.0.0.1:50051"))
    ap.add_argument("--token-file", default=os.environ.get("HMOE_TOKEN_FILE"),
                    help="file with the worker's --auth-token-file token (default $HMOE_TOKEN_FILE)")
    ap.add_argument("--tls-ca-file", default=os.environ.get("HMOE_TLS_CA_FILE"),
                    help="TLS: the CA that signed the worker's certificate (default $HMOE_TLS_CA_FILE)")
    ap.add_argument("--tls-cert-file", help="TLS: client certificate (mutual TLS)")
    ap.add_argument("--tls-key-file", help="TLS: the client certificate's key")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--add-special-tokens", action="store_true")
    sub.add_parser("info")
    sub.add_parser("stats")
    t = sub.add_parser("tokenize")
    t.add_argument("text")
    a = ap.parse_args()
    try:
        def pem(path):
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()
        c = Client(a.server, token=read_token_file(a.token_file) if a.token_file else None,
                   tls_ca=pem(a.tls_ca_file), tls_cert=pem(a.tls_cert_file), tls_key=pem(a.tls_key_file))
        if a.cmd == "generate":
            start = time.time()
            n = 0
            print(a.prompt, end="", flush=True)
            for chunk in c.generate_stream(a.prompt, max_tokens=a.max_tokens, stop=a.stop, ignore_eos=a.ignore_eos,
                                           add_special_tokens=a.add_special_tokens, temperature=a.temperature,
                                           top_k=a.top_k, top_p=a.top_p, seed=a.seed):
                print(chunk.text, end="", flush=True)
                n += len(chunk.token_ids)
            print()
            print(f"-- {n} tokens in {time.time() - start:.3f} s", file=sys.stderr)
        elif a.cmd == "info":
            print(c.model_info())
        elif a.cmd == "stats":
            print(c.stats())
        elif a.cmd == "tokenize":
            print(c.tokenize(a.text))
    except grpc.RpcError as e:
        print(f"hmoe_client: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except grpc.FutureTimeoutError:
        print(f"hmoe_client: cannot connect to {a.server} (unreachable, or a TLS handshake that "
              "failed: check --tls-ca-file)", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"hmoe_client: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
