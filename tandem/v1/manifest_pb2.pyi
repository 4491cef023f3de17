from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ActivationSite(_message.Message):
    __slots__ = ("name", "format", "scope", "tp_scale_mode")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TP_SCALE_MODE_FIELD_NUMBER: _ClassVar[int]
    name: str
    format: str
    scope: str
    tp_scale_mode: str
    def __init__(self, name: _Optional[str] = ..., format: _Optional[str] = ..., scope: _Optional[str] = ..., tp_scale_mode: _Optional[str] = ...) -> None: ...

class TpRule(_message.Message):
    __slots__ = ("pattern", "style")
    PATTERN_FIELD_NUMBER: _ClassVar[int]
    STYLE_FIELD_NUMBER: _ClassVar[int]
    pattern: str
    style: str
    def __init__(self, pattern: _Optional[str] = ..., style: _Optional[str] = ...) -> None: ...

class TpPlan(_message.Message):
    __slots__ = ("rules", "partition_tp_size")
    RULES_FIELD_NUMBER: _ClassVar[int]
    PARTITION_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    rules: _containers.RepeatedCompositeFieldContainer[TpRule]
    partition_tp_size: int
    def __init__(self, rules: _Optional[_Iterable[_Union[TpRule, _Mapping]]] = ..., partition_tp_size: _Optional[int] = ...) -> None: ...

class Contract(_message.Message):
    __slots__ = ("model_config_json", "model_config_sha256", "recipe_name", "recipe_rules_json", "recipe_sha256", "quantizer_spec_version", "activation_sites", "tp_plan")
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    RECIPE_NAME_FIELD_NUMBER: _ClassVar[int]
    RECIPE_RULES_JSON_FIELD_NUMBER: _ClassVar[int]
    RECIPE_SHA256_FIELD_NUMBER: _ClassVar[int]
    QUANTIZER_SPEC_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_SITES_FIELD_NUMBER: _ClassVar[int]
    TP_PLAN_FIELD_NUMBER: _ClassVar[int]
    model_config_json: str
    model_config_sha256: str
    recipe_name: str
    recipe_rules_json: str
    recipe_sha256: str
    quantizer_spec_version: str
    activation_sites: _containers.RepeatedCompositeFieldContainer[ActivationSite]
    tp_plan: TpPlan
    def __init__(self, model_config_json: _Optional[str] = ..., model_config_sha256: _Optional[str] = ..., recipe_name: _Optional[str] = ..., recipe_rules_json: _Optional[str] = ..., recipe_sha256: _Optional[str] = ..., quantizer_spec_version: _Optional[str] = ..., activation_sites: _Optional[_Iterable[_Union[ActivationSite, _Mapping]]] = ..., tp_plan: _Optional[_Union[TpPlan, _Mapping]] = ...) -> None: ...

class TensorPart(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "format", "format_params_json", "shape", "parts", "nbytes", "global_scale", "tp_style", "chunk_xxh3", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    FORMAT_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SCALE_FIELD_NUMBER: _ClassVar[int]
    TP_STYLE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_XXH3_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    format: str
    format_params_json: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    parts: _containers.RepeatedCompositeFieldContainer[TensorPart]
    nbytes: int
    global_scale: float
    tp_style: str
    chunk_xxh3: _containers.RepeatedScalarFieldContainer[int]
    sha256: bytes
    def __init__(self, name: _Optional[str] = ..., format: _Optional[str] = ..., format_params_json: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., parts: _Optional[_Iterable[_Union[TensorPart, _Mapping]]] = ..., nbytes: _Optional[int] = ..., global_scale: _Optional[float] = ..., tp_style: _Optional[str] = ..., chunk_xxh3: _Optional[_Iterable[int]] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("schema_version", "version", "parent_version", "created_unix_ns", "contract", "contract_fingerprint", "chunk_bytes", "tensors", "total_bytes")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FIELD_NUMBER: _ClassVar[int]
    CONTRACT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    version: int
    parent_version: int
    created_unix_ns: int
    contract: Contract
    contract_fingerprint: str
    chunk_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    total_bytes: int
    def __init__(self, schema_version: _Optional[int] = ..., version: _Optional[int] = ..., parent_version: _Optional[int] = ..., created_unix_ns: _Optional[int] = ..., contract: _Optional[_Union[Contract, _Mapping]] = ..., contract_fingerprint: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., total_bytes: _Optional[int] = ...) -> None: ...
