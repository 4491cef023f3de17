from tandem.v1 import manifest_pb2 as _manifest_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeltaEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELTA_ENCODING_UNSPECIFIED: _ClassVar[DeltaEncoding]
    UNCHANGED: _ClassVar[DeltaEncoding]
    XOR_ZSTD: _ClassVar[DeltaEncoding]
DELTA_ENCODING_UNSPECIFIED: DeltaEncoding
UNCHANGED: DeltaEncoding
XOR_ZSTD: DeltaEncoding

class GetManifestRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class FetchTensorsRequest(_message.Message):
    __slots__ = ("version", "tensor_names", "tp_rank", "tp_size", "start_chunk", "held")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAMES_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    START_CHUNK_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensor_names: _containers.RepeatedScalarFieldContainer[str]
    tp_rank: int
    tp_size: int
    start_chunk: int
    held: _containers.RepeatedCompositeFieldContainer[HeldVersion]
    def __init__(self, version: _Optional[int] = ..., tensor_names: _Optional[_Iterable[str]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., start_chunk: _Optional[int] = ..., held: _Optional[_Iterable[_Union[HeldVersion, _Mapping]]] = ...) -> None: ...

class HeldVersion(_message.Message):
    __slots__ = ("version", "manifest_digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    manifest_digest: bytes
    def __init__(self, version: _Optional[int] = ..., manifest_digest: _Optional[bytes] = ...) -> None: ...

class DeltaTensor(_message.Message):
    __slots__ = ("name", "encoding", "payload_bytes", "frame_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    encoding: DeltaEncoding
    payload_bytes: int
    frame_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., encoding: _Optional[_Union[DeltaEncoding, str]] = ..., payload_bytes: _Optional[int] = ..., frame_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class DeltaDescription(_message.Message):
    __slots__ = ("parent_version", "parent_manifest_digest", "tensors", "frame_tensor_bytes")
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FRAME_TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    parent_version: int
    parent_manifest_digest: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[DeltaTensor]
    frame_tensor_bytes: int
    def __init__(self, parent_version: _Optional[int] = ..., parent_manifest_digest: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[DeltaTensor, _Mapping]]] = ..., frame_tensor_bytes: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("version", "chunk_index", "tensor_name", "tensor_nbytes", "offset", "xxh3", "tensor_sha256", "delta", "data")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NBYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SHA256_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    chunk_index: int
    tensor_name: str
    tensor_nbytes: int
    offset: int
    xxh3: int
    tensor_sha256: bytes
    delta: DeltaDescription
    data: bytes
    def __init__(self, version: _Optional[int] = ..., chunk_index: _Optional[int] = ..., tensor_name: _Optional[str] = ..., tensor_nbytes: _Optional[int] = ..., offset: _Optional[int] = ..., xxh3: _Optional[int] = ..., tensor_sha256: _Optional[bytes] = ..., delta: _Optional[_Union[DeltaDescription, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

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
