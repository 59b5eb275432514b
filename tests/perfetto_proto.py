"""The subset of Perfetto's trace protos (perfetto/protos/perfetto/trace/) a
test needs to read an exported trace back, declared as descriptors and read
by the real protobuf library: an independent decoder of `watcher export`."""

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

F = descriptor_pb2.FieldDescriptorProto

# message -> [(field name, number, type, label, message type name)]
MESSAGES = {
    "Trace": [("packet", 1, F.TYPE_MESSAGE, F.LABEL_REPEATED, "TracePacket")],
    "TracePacket": [("timestamp", 8, F.TYPE_UINT64, F.LABEL_OPTIONAL, None),
                    ("trusted_packet_sequence_id", 10, F.TYPE_UINT32, F.LABEL_OPTIONAL, None),
                    ("track_event", 11, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, "TrackEvent"),
                    ("interned_data", 12, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, "InternedData"),
                    ("sequence_flags", 13, F.TYPE_UINT32, F.LABEL_OPTIONAL, None),
                    ("track_descriptor", 60, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, "TrackDescriptor")],
    "TrackEvent": [("debug_annotations", 4, F.TYPE_MESSAGE, F.LABEL_REPEATED, "DebugAnnotation"),
                   ("type", 9, F.TYPE_INT32, F.LABEL_OPTIONAL, None),
                   ("name_iid", 10, F.TYPE_UINT64, F.LABEL_OPTIONAL, None),
                   ("track_uuid", 11, F.TYPE_UINT64, F.LABEL_OPTIONAL, None),
                   ("name", 23, F.TYPE_STRING, F.LABEL_OPTIONAL, None),
                   ("double_counter_value", 44, F.TYPE_DOUBLE, F.LABEL_OPTIONAL, None)],
    "DebugAnnotation": [("int_value", 4, F.TYPE_INT64, F.LABEL_OPTIONAL, None),
                        ("double_value", 5, F.TYPE_DOUBLE, F.LABEL_OPTIONAL, None),
                        ("string_value", 6, F.TYPE_STRING, F.LABEL_OPTIONAL, None),
                        ("name", 10, F.TYPE_STRING, F.LABEL_OPTIONAL, None)],
    "InternedData": [("event_names", 2, F.TYPE_MESSAGE, F.LABEL_REPEATED, "EventName")],
    "EventName": [("iid", 1, F.TYPE_UINT64, F.LABEL_OPTIONAL, None),
                  ("name", 2, F.TYPE_STRING, F.LABEL_OPTIONAL, None)],
    "TrackDescriptor": [("uuid", 1, F.TYPE_UINT64, F.LABEL_OPTIONAL, None),
                        ("name", 2, F.TYPE_STRING, F.LABEL_OPTIONAL, None),
                        ("process", 3, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, "ProcessDescriptor"),
                        ("parent_uuid", 5, F.TYPE_UINT64, F.LABEL_OPTIONAL, None),
                        ("counter", 8, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, "CounterDescriptor")],
    "ProcessDescriptor": [("pid", 1, F.TYPE_INT32, F.LABEL_OPTIONAL, None),
                          ("process_name", 6, F.TYPE_STRING, F.LABEL_OPTIONAL, None)],
    "CounterDescriptor": [],
}


def trace_class():
    f = descriptor_pb2.FileDescriptorProto(name="perfetto_subset.proto", package="perfetto.protos")
    for name, fields in MESSAGES.items():
        m = f.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            fd = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                fd.type_name = f".perfetto.protos.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("perfetto.protos.Trace"))


def read(path) -> object:
    trace = trace_class()()
    with open(path, "rb") as fh:
        trace.ParseFromString(fh.read())
    return trace
