from tandem.v1 import manifest_pb2 as _manifest_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetManifestRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class FetchTensorsRequest(_message.Message):
    __slots__ = ("version", "tensor_names", "tp_rank", "tp_size", "start_chunk")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAMES_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    START_CHUNK_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensor_names: _containers.RepeatedScalarFieldContainer[str]
    tp_rank: int
    tp_size: int
    start_chunk: int
    def __init__(self, version: _Optional[int] = ..., tensor_names: _Optional[_Iterable[str]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., start_chunk: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("version", "chunk_index", "tensor_name", "tensor_nbytes", "offset", "xxh3", "tensor_sha256", "data")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NBYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SHA256_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    chunk_index: int
    tensor_name: str
    tensor_nbytes: int
    offset: int
    xxh3: int
    tensor_sha256: bytes
    data: bytes
    def __init__(self, version: _Optional[int] = ..., chunk_index: _Optional[int] = ..., tensor_name: _Optional[str] = ..., tensor_nbytes: _Optional[int] = ..., offset: _Optional[int] = ..., xxh3: _Optional[int] = ..., tensor_sha256: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class WatchVersionsRequest(_message.Message):
    __slots__ = ("after_version",)
    AFTER_VERSION_FIELD_NUMBER: _ClassVar[int]
    after_version: int
    def __init__(self, after_version: _Optional[int] = ...) -> None: ...

class VersionAnnouncement(_message.Message):
    __slots__ = ("version", "parent_version", "created_unix_ns", "contract_fingerprint", "total_bytes", "tensor_count")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    version: int
    parent_version: int
    created_unix_ns: int
    contract_fingerprint: str
    total_bytes: int
    tensor_count: int
    def __init__(self, version: _Optional[int] = ..., parent_version: _Optional[int] = ..., created_unix_ns: _Optional[int] = ..., contract_fingerprint: _Optional[str] = ..., total_bytes: _Optional[int] = ..., tensor_count: _Optional[int] = ...) -> None: ...
