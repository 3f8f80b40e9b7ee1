"""Requests between peers outside sessions, as protobuf messages dispatched by kind."""

from meshd.rpc.router import RPC_PATH, RpcFailed, RpcRouter, call, error_reply, reply_of

__all__ = ["RPC_PATH", "RpcFailed", "RpcRouter", "call", "error_reply", "reply_of"]
