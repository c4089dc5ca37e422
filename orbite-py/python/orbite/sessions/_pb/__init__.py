# SPDX-License-Identifier: Apache-2.0
"""Generated code of proto/orbite/kv/v1/kv_session.proto (package
`orbite.kv.v1`): `kv_session_pb2` (messages and enums, with a `.pyi`) and
`kv_session_pb2_grpc` (the `OpenEngineKv` and `OrbiteDiagnostics` stubs).

Do not edit the generated files: `scripts/py-grpc-stubs` regenerates them
and `scripts/py-grpc-stubs --check` fails when they are stale. Use
`orbite.sessions` instead of importing them directly.
"""
