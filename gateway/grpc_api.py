"""gRPC ``kvserve.v1.Gateway``: protobuf ⇄ domain, nothing else."""
from __future__ import annotations

from gateway.constraints import ConstraintSpec, GrammarCompiler
from gateway.detokenizer import ModelTokenizer
from gateway.engine import Engine
from gateway.params import build_options
from gateway.sequence import FinishReason, PredictionTokens, RequestOutput
from gateway.model_name import check_model_name
from gateway.tenants import TENANT_HEADER, TenantResolver
from kvserve.errors import InvalidArgument, Unavailable
from kvserve.v1 import gateway_pb2, gateway_pb2_grpc

# Longest prompt text accepted (the HTTP API's body limit is 4 MiB; gRPC messages may be 64 MiB).
MAX_TEXT_CHARS = 4 * 1024 * 1024

# GenerationParams.kv_cache_priority → the HTTP API's name.
CACHE_PRIORITIES = {
    gateway_pb2.KV_CACHE_PRIORITY_UNSPECIFIED: "normal",
    gateway_pb2.KV_CACHE_PRIORITY_NORMAL: "normal",
    gateway_pb2.KV_CACHE_PRIORITY_LOW: "low",
}

FINISH = {
    None: gateway_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: gateway_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: gateway_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: gateway_pb2.FINISH_REASON_ABORT,
}


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, engine: Engine, tokenizer: ModelTokenizer, describe_batching: dict,
                 grammars: GrammarCompiler | None = None, tenants: TenantResolver | None = None):
        self._tenants = tenants or TenantResolver()
        self._engine = engine
        self._tokenizer = tokenizer
        self._batching = describe_batching
        self._grammars = grammars or GrammarCompiler.for_tokenizer(tokenizer)

    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        engine = self._engine
        check_model_name(request.model, engine.model_name)
        kind = request.WhichOneof("prompt")
        limit = engine.max_model_len
        if kind == "text":  # protobuf strings are valid UTF-8: no lone surrogates can arrive here
            if len(request.text) > MAX_TEXT_CHARS:
                raise InvalidArgument(f"text: at most {MAX_TEXT_CHARS} characters, got {len(request.text)}")
            prompt_ids = await self._tokenizer.encode_async(request.text, True, limit)
        elif kind == "token_ids":
            ids = request.token_ids.ids
            if limit and len(ids) >= limit:  # before copying what may be millions of ids
                raise InvalidArgument(f"prompt is too long: {len(ids)} tokens, but max_model_len is {limit} "
                                      f"(prompt + output), leaving no room to generate")
            prompt_ids = list(ids)
        else:
            raise InvalidArgument("prompt: set text or token_ids")
        tenant = self._tenant(context)
        p = request.params
        spec = _constraint_spec(p.constraint) if p.HasField("constraint") else None
        compiled = await self._grammars.compile(spec) if spec is not None else None
        predicted = None
        if p.HasField("prediction"):
            if len(p.prediction) > MAX_TEXT_CHARS:
                raise InvalidArgument(f"prediction: at most {MAX_TEXT_CHARS} characters, got {len(p.prediction)}")
            predicted = (await self._tokenizer.encode_async(p.prediction))[:limit]
        options = build_options(
            max_tokens=p.max_tokens or None, temperature=p.temperature, top_p=p.top_p or None, top_k=p.top_k,
            seed=p.seed if p.HasField("seed") else None, stop=p.stop, stop_token_ids=p.stop_token_ids,
            ignore_eos=p.ignore_eos, min_tokens=p.min_tokens, n=p.n or 1,
            logprobs=p.logprobs if p.HasField("logprobs") else None, prompt_logprobs=0 if p.prompt_logprobs else None,
            enable_prefix_caching=not p.disable_prefix_cache, cache_salt=p.cache_salt,
            default_temperature=0.0, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty or None, logit_bias=dict(p.logit_bias), min_p=p.min_p,
            constraint=compiled, tenant=tenant,
            kv_shared_prefix_tokens=p.kv_shared_prefix_tokens,
            kv_cache_ttl_s=p.kv_cache_ttl_s if p.HasField("kv_cache_ttl_s") else None,
            kv_cache_priority=CACHE_PRIORITIES.get(p.kv_cache_priority, p.kv_cache_priority),
            predicted_token_ids=predicted,
        )
        engine.metrics.on_tenant_request(tenant)
        # The client's deadline: the request fails (and frees its blocks) when it passes.
        stream = await engine.submit(prompt_ids, options, request.request_id or None,
                                     timeout_s=context.time_remaining())
        finished = False
        try:
            async for output in stream:
                for message in _messages(output):
                    yield message
                finished = output.finished
        finally:
            if not finished:  # cancelled by the client
                engine.abort(stream.request_id)

    def _tenant(self, context) -> str:
        """From the ``authorization`` (the key's tenant) and ``x-kvserve-tenant`` metadata."""
        metadata = context.invocation_metadata() or ()
        authorization = [v for k, v in metadata if k == "authorization"]
        header = [v for k, v in metadata if k == TENANT_HEADER]
        if len(header) > 1 and not self._tenants.by_key:
            raise InvalidArgument(f"{TENANT_HEADER} metadata: give it once")
        return self._tenants.resolve(authorization[0] if len(authorization) == 1 else None,
                                     header[0] if header else None)

    async def Abort(self, request: gateway_pb2.AbortRequest, context):
        return gateway_pb2.AbortResponse(aborted=self._engine.abort(request.request_id))

    async def GetModelInfo(self, request: gateway_pb2.GetModelInfoRequest, context):
        engine = self._engine
        await engine.ensure_connected()
        info = engine.info
        if info is None:
            raise Unavailable("executor not described yet")
        return gateway_pb2.ModelInfo(
            model_name=engine.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            block_size=info.block_size, num_blocks=info.num_blocks, dtype=info.dtype, device=info.device,
            attention_backend=info.attention_backend, **self._batching,
        )


def _constraint_spec(constraint: gateway_pb2.OutputConstraint) -> ConstraintSpec | None:
    kind = constraint.WhichOneof("kind")
    if kind is None:
        return None
    where = f"constraint.{kind}"
    try:
        if kind == "json_schema":
            return ConstraintSpec.json_schema(constraint.json_schema).named(where)
        if kind == "json_object":
            return ConstraintSpec("json_object").named(where) if constraint.json_object else None
        if kind == "choice":
            return ConstraintSpec.choice(list(constraint.choice.choices)).named(where)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
    return ConstraintSpec(kind, getattr(constraint, kind), where)


def _messages(output: RequestOutput) -> list[gateway_pb2.GenerateResponse]:
    messages = []
    for delta in output.choices:
        stop_reason = "" if delta.stop_reason is None else str(delta.stop_reason)
        messages.append(gateway_pb2.GenerateResponse(
            request_id=output.request_id, index=delta.index, token_ids=delta.token_ids, text=delta.text,
            finish_reason=FINISH[delta.finish_reason], logprobs=delta.logprobs, stop_reason=stop_reason,
            prompt_logprobs=[score.logprob for score in delta.prompt_logprobs or ()],
            top_logprobs=[gateway_pb2.TokenAlternatives(token_ids=[t for t, _ in top], logprobs=[p for _, p in top])
                          for top in delta.top_logprobs],
        ))
    if output.finished:
        if not messages:
            messages.append(gateway_pb2.GenerateResponse(request_id=output.request_id))
        predicted = output.prediction_tokens or PredictionTokens()
        messages[-1].usage.CopyFrom(gateway_pb2.Usage(
            prompt_tokens=output.prompt_tokens, completion_tokens=output.completion_tokens,
            cached_tokens=output.cached_tokens, accepted_prediction_tokens=predicted.accepted,
            rejected_prediction_tokens=predicted.rejected))
    return messages
