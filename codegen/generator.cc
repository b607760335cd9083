#include "codegen/generator.h"

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "google/protobuf/compiler/cpp/names.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/io/printer.h"
#include "google/protobuf/io/zero_copy_stream.h"

namespace rdmarpc::codegen {
namespace {

using ::google::protobuf::Descriptor;
using ::google::protobuf::FieldDescriptor;
using ::google::protobuf::FileDescriptor;
using ::google::protobuf::MethodDescriptor;
using ::google::protobuf::ServiceDescriptor;
using ::google::protobuf::SourceLocation;
using ::google::protobuf::compiler::GeneratorContext;
using ::google::protobuf::io::Printer;
using ::google::protobuf::io::ZeroCopyOutputStream;
using Vars = std::map<std::string, std::string>;

constexpr std::string_view kTensorType = "rdmarpc.Tensor";
constexpr char kMapAdvice[] =
    "tensor fields in maps are not supported (use a repeated message with a "
    "key field)";

const char* StreamingKind(const MethodDescriptor& method) {
  if (method.client_streaming() && method.server_streaming()) {
    return "bidi-streaming (client and server streaming)";
  }
  return method.client_streaming() ? "client-streaming" : "server-streaming";
}

// The full name of an rdmarpc.Tensor field in `type` or in any message it
// contains, or "" if there is none.
std::string FindTensorField(const Descriptor* type,
                            std::set<const Descriptor*>* seen) {
  if (!seen->insert(type).second) return "";
  for (int i = 0; i < type->field_count(); ++i) {
    const FieldDescriptor* field = type->field(i);
    const Descriptor* sub = field->message_type();
    if (sub == nullptr) continue;
    if (sub->full_name() == kTensorType) return field->full_name();
    if (std::string found = FindTensorField(sub, seen); !found.empty()) {
      return found;
    }
  }
  return "";
}

// Rejects map fields that hold tensors in their values, in `type` and in
// every message reachable from it: the runtime matches tensors between peers
// by their order in a walk over the message, and map order is not stable.
bool CheckTensorMaps(const Descriptor* type, std::set<const Descriptor*>* seen,
                     std::string* error) {
  if (!seen->insert(type).second) return true;
  for (int i = 0; i < type->field_count(); ++i) {
    const FieldDescriptor* field = type->field(i);
    const Descriptor* sub = field->message_type();
    if (sub == nullptr) continue;
    const Descriptor* value =
        field->is_map() ? sub->map_value()->message_type() : nullptr;
    if (value != nullptr) {
      if (value->full_name() == kTensorType) {
        *error = "rdmarpc: field " + field->full_name() +
                 " is a map with rdmarpc.Tensor values; " + kMapAdvice;
        return false;
      }
      std::set<const Descriptor*> visited;
      if (std::string tensor = FindTensorField(value, &visited);
          !tensor.empty()) {
        *error = "rdmarpc: field " + field->full_name() +
                 " is a map whose values (" + value->full_name() +
                 ") hold rdmarpc.Tensor field " + tensor + "; " + kMapAdvice;
        return false;
      }
    }
    if (!CheckTensorMaps(sub, seen, error)) return false;
  }
  return true;
}

// The fields a tensor walker of `type` visits, in field-number order (the
// walk order): those that can hold a tensor below them, as the runtime's
// reflection walk picks them (runtime/tensor_walk.cc). Empty when the
// runtime walks `type` through reflection instead: types with extension
// ranges (the runtime walks whatever is set, extensions included) and
// types with weak fields (no generated accessors to read them with).
std::vector<const FieldDescriptor*> WalkedFields(const Descriptor& type) {
  std::vector<const FieldDescriptor*> fields;
  if (type.extension_range_count() > 0 || type.options().map_entry()) {
    return fields;
  }
  for (int i = 0; i < type.field_count(); ++i) {
    const FieldDescriptor* field = type.field(i);
    const Descriptor* sub = field->message_type();
    std::set<const Descriptor*> seen;
    if (sub == nullptr || (sub->full_name() != kTensorType &&
                           FindTensorField(sub, &seen).empty())) {
      continue;
    }
    if (field->options().weak()) return {};
    fields.push_back(field);
  }
  std::sort(fields.begin(), fields.end(),
            [](const FieldDescriptor* a, const FieldDescriptor* b) {
              return a->number() < b->number();
            });
  return fields;
}

// The message types of `file` that get a tensor walker, nested ones
// included, in declaration order.
void AddWalkedTypes(const Descriptor& type,
                    std::vector<const Descriptor*>* walked) {
  if (!WalkedFields(type).empty()) walked->push_back(&type);
  for (int i = 0; i < type.nested_type_count(); ++i) {
    AddWalkedTypes(*type.nested_type(i), walked);
  }
}

std::vector<const Descriptor*> WalkedTypes(const FileDescriptor& file) {
  std::vector<const Descriptor*> walked;
  for (int i = 0; i < file.message_type_count(); ++i) {
    AddWalkedTypes(*file.message_type(i), &walked);
  }
  return walked;
}

// Each C++ member name in the generated classes must come from one source
// only; otherwise the output would not compile or would overload silently.
bool CheckNames(const ServiceDescriptor& service, std::string* error) {
  std::map<std::string, std::string> owners = {
      {"Service", "the generated class Service"},
      {"Stub", "the generated class Stub"},
      {"StubInterface", "the generated class StubInterface"},
      {"NewStub", "the generated function NewStub"},
      {"kServiceName", "the generated constant kServiceName"},
      {"methods", "the inherited rdmarpc::Service::methods()"},
      {"AddUnaryMethod", "the inherited rdmarpc::Service::AddUnaryMethod()"},
      {"channel_", "the generated member Stub::channel_"},
  };
  for (int i = 0; i < service.method_count(); ++i) {
    const std::string& name = service.method(i)->name();
    const std::pair<std::string, std::string> members[] = {
        {name, "method " + name},
        {name + "Future", "the future form of method " + name},
    };
    for (const auto& [member, owner] : members) {
      auto [it, added] = owners.emplace(member, owner);
      if (!added) {
        *error = "rdmarpc: in service " + service.full_name() + ", " + owner +
                 " collides with " + it->second + " (both are named " + member +
                 " in the generated C++ code); rename the method";
        return false;
      }
    }
  }
  return true;
}

bool Validate(const FileDescriptor& file, std::string* error) {
  std::set<const Descriptor*> checked;
  for (int s = 0; s < file.service_count(); ++s) {
    const ServiceDescriptor& service = *file.service(s);
    if (!CheckNames(service, error)) return false;
    for (int m = 0; m < service.method_count(); ++m) {
      const MethodDescriptor& method = *service.method(m);
      if (method.client_streaming() || method.server_streaming()) {
        *error = "rdmarpc: method " + method.full_name() + " is " +
                 StreamingKind(method) +
                 "; streaming methods are not supported yet, only unary "
                 "methods";
        return false;
      }
      const std::pair<const char*, const Descriptor*> messages[] = {
          {"request", method.input_type()},
          {"response", method.output_type()},
      };
      for (const auto& [role, type] : messages) {
        // The runtime looks for tensors inside a call's messages only.
        if (type->full_name() == kTensorType) {
          *error = "rdmarpc: method " + method.full_name() +
                   " has rdmarpc.Tensor itself as its " + role +
                   " type; wrap the tensor in a message";
          return false;
        }
        if (!CheckTensorMaps(type, &checked, error)) return false;
      }
    }
  }
  return true;
}

// "dir/x.rdmarpc.pb.h" -> "RDMARPC_GEN_DIR_X_RDMARPC_PB_H_". The prefix
// keeps the macro valid when the file name starts with a digit.
std::string IncludeGuard(const std::string& header) {
  std::string guard = "RDMARPC_GEN_";
  for (char c : header) {
    if (c >= 'a' && c <= 'z') {
      guard += static_cast<char>(c - 'a' + 'A');
    } else if ((c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) {
      guard += c;
    } else {
      guard += '_';
    }
  }
  return guard + "_";
}

// "a.b" -> "a::b"; C++17 nested namespace definitions take it as is.
std::string CppNamespace(const FileDescriptor& file) {
  std::string ns;
  for (char c : file.package()) {
    if (c == '.') {
      ns += "::";
    } else {
      ns += c;
    }
  }
  return ns;
}

// Copies the leading comment of `descriptor` from the .proto file.
template <typename DescriptorT>
void PrintLeadingComment(const DescriptorT& descriptor, Printer* p) {
  SourceLocation location;
  if (!descriptor.GetSourceLocation(&location)) return;
  std::vector<std::string> lines;
  std::string_view text = location.leading_comments;
  while (!text.empty()) {
    size_t end = text.find('\n');
    std::string line(text.substr(0, end));
    // A trailing backslash would splice the next generated line into the
    // comment.
    while (!line.empty() && (line.back() == ' ' || line.back() == '\t' ||
                             line.back() == '\r' || line.back() == '\\')) {
      line.pop_back();
    }
    lines.push_back(std::move(line));
    text = end == std::string_view::npos ? "" : text.substr(end + 1);
  }
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  for (const std::string& line : lines) {
    p->Print("//$line$\n", "line", line);
  }
}

Vars ServiceVars(const ServiceDescriptor& service) {
  return {{"service", service.name()}, {"full_name", service.full_name()}};
}

Vars MethodVars(const MethodDescriptor& method) {
  Vars vars = ServiceVars(*method.service());
  vars["method"] = method.name();
  vars["path"] = "/" + method.service()->full_name() + "/" + method.name();
  vars["request"] =
      google::protobuf::compiler::cpp::QualifiedClassName(method.input_type());
  vars["response"] =
      google::protobuf::compiler::cpp::QualifiedClassName(method.output_type());
  return vars;
}

void PrintServiceDeclaration(const ServiceDescriptor& service, Printer* p) {
  const Vars vars = ServiceVars(service);
  PrintLeadingComment(service, p);
  p->Print(vars,
           "class $service$ final {\n"
           " public:\n"
           "  static constexpr char kServiceName[] = \"$full_name$\";\n"
           "\n"
           "  // Base of a server's implementation: override the methods\n"
           "  // it serves; the others answer UNIMPLEMENTED.\n"
           "  class Service : public ::rdmarpc::Service {\n"
           "   public:\n"
           "    Service();\n"
           "    // The registered handlers capture `this`, so a copy\n"
           "    // would call into the original.\n"
           "    Service(const Service&) = delete;\n"
           "    Service& operator=(const Service&) = delete;\n"
           "    ~Service() override = default;\n");
  p->Indent();
  p->Indent();
  for (int i = 0; i < service.method_count(); ++i) {
    const MethodDescriptor& method = *service.method(i);
    p->Print("\n");
    PrintLeadingComment(method, p);
    p->Print(MethodVars(method),
             "virtual ::rdmarpc::Status $method$(\n"
             "    ::rdmarpc::ServerContext* context,\n"
             "    const $request$& request,\n"
             "    $response$* response);\n");
  }
  p->Outdent();
  p->Outdent();
  p->Print(
      "  };\n"
      "\n"
      "  // Client side. Each method comes in three forms: blocking,\n"
      "  // with a callback `done` that runs exactly once, and\n"
      "  // MethodFuture. The context, request, response and bound\n"
      "  // tensors are borrowed until the call completes (see\n"
      "  // rdmarpc::ChannelInterface). Client code that takes a\n"
      "  // StubInterface can be tested with a mock of it.\n"
      "  class StubInterface {\n"
      "   public:\n"
      "    virtual ~StubInterface() = default;\n");
  // `suffix` ends each declaration: " = 0;" in the interface,
  // " override;" in the Stub.
  auto declare_methods = [&](const char* virtual_prefix, const char* suffix) {
    p->Indent();
    p->Indent();
    for (int i = 0; i < service.method_count(); ++i) {
      const MethodDescriptor& method = *service.method(i);
      Vars vars = MethodVars(method);
      vars["virtual"] = virtual_prefix;
      vars["suffix"] = suffix;
      p->Print("\n");
      PrintLeadingComment(method, p);
      p->Print(vars,
               "$virtual$::rdmarpc::Status $method$(\n"
               "    ::rdmarpc::ClientContext* context,\n"
               "    const $request$& request,\n"
               "    $response$* response)$suffix$\n"
               "$virtual$void $method$(\n"
               "    ::rdmarpc::ClientContext* context,\n"
               "    const $request$& request,\n"
               "    $response$* response,\n"
               "    std::function<void(::rdmarpc::Status)> done)$suffix$\n"
               "$virtual$std::future<::rdmarpc::Status> $method$Future(\n"
               "    ::rdmarpc::ClientContext* context,\n"
               "    const $request$& request,\n"
               "    $response$* response)$suffix$\n");
    }
    p->Outdent();
    p->Outdent();
  };
  declare_methods("virtual ", " = 0;");
  p->Print(
      "  };\n"
      "\n"
      "  class Stub final : public StubInterface {\n"
      "   public:\n"
      "    explicit Stub(\n"
      "        std::shared_ptr<::rdmarpc::ChannelInterface> channel);\n");
  declare_methods("", " override;");
  p->Print(
      "\n"
      "   private:\n"
      "    std::shared_ptr<::rdmarpc::ChannelInterface> channel_;\n"
      "  };\n"
      "\n"
      "  static std::unique_ptr<Stub> NewStub(\n"
      "      std::shared_ptr<::rdmarpc::ChannelInterface> channel);\n"
      "};\n");
}

void PrintServiceDefinition(const ServiceDescriptor& service, Printer* p) {
  const Vars vars = ServiceVars(service);
  if (service.method_count() == 0) {
    p->Print(vars, "$service$::Service::Service() = default;\n");
  } else {
    p->Print(vars, "$service$::Service::Service() {\n");
    for (int i = 0; i < service.method_count(); ++i) {
      // `this->` because a lambda parameter may share the method's name.
      p->Print(MethodVars(*service.method(i)),
               "  AddUnaryMethod<$request$,\n"
               "                 $response$>(\n"
               "      \"$path$\",\n"
               "      [this](::rdmarpc::ServerContext* context,\n"
               "             const $request$& request,\n"
               "             $response$* response) {\n"
               "        return this->$method$(context, request, response);\n"
               "      });\n");
    }
    p->Print("}\n");
  }
  for (int i = 0; i < service.method_count(); ++i) {
    p->Print(MethodVars(*service.method(i)),
             "\n"
             "::rdmarpc::Status $service$::Service::$method$(\n"
             "    ::rdmarpc::ServerContext* /*context*/,\n"
             "    const $request$& /*request*/,\n"
             "    $response$* /*response*/) {\n"
             "  return ::absl::UnimplementedError(\n"
             "      \"method $path$\"\n"
             "      \" is not implemented by this server\");\n"
             "}\n");
  }
  p->Print(vars,
           "\n"
           "$service$::Stub::Stub(\n"
           "    std::shared_ptr<::rdmarpc::ChannelInterface> channel)\n"
           "    : channel_(std::move(channel)) {}\n");
  for (int i = 0; i < service.method_count(); ++i) {
    p->Print(MethodVars(*service.method(i)),
             "\n"
             "::rdmarpc::Status $service$::Stub::$method$(\n"
             "    ::rdmarpc::ClientContext* context,\n"
             "    const $request$& request,\n"
             "    $response$* response) {\n"
             "  return channel_->Call(\n"
             "      \"$path$\", context, request, response);\n"
             "}\n"
             "\n"
             "void $service$::Stub::$method$(\n"
             "    ::rdmarpc::ClientContext* context,\n"
             "    const $request$& request,\n"
             "    $response$* response,\n"
             "    std::function<void(::rdmarpc::Status)> done) {\n"
             "  channel_->CallAsync(\"$path$\", context, request, response,\n"
             "                      std::move(done));\n"
             "}\n"
             "\n"
             "std::future<::rdmarpc::Status> $service$::Stub::$method$Future(\n"
             "    ::rdmarpc::ClientContext* context,\n"
             "    const $request$& request,\n"
             "    $response$* response) {\n"
             "  return channel_->CallFuture(\n"
             "      \"$path$\", context, request, response);\n"
             "}\n");
  }
  p->Print(vars,
           "\n"
           "std::unique_ptr<$service$::Stub> $service$::NewStub(\n"
           "    std::shared_ptr<::rdmarpc::ChannelInterface> channel) {\n"
           "  return std::make_unique<Stub>(std::move(channel));\n"
           "}\n");
}

std::string WalkerName(const Descriptor& type) {
  return "WalkTensorsOf" + google::protobuf::compiler::cpp::ClassName(&type);
}

// A walker per type (rdmarpc/generated_support.h): the runtime's
// reflection walk, with generated accessors in place of reflection.
void PrintTensorWalkers(const std::vector<const Descriptor*>& types,
                        Printer* p) {
  p->Print("namespace {\n");
  for (const Descriptor* type : types) {
    p->Print(
        {{"walker", WalkerName(*type)},
         {"class", google::protobuf::compiler::cpp::QualifiedClassName(type)}},
        "\n"
        "::rdmarpc::Status $walker$(\n"
        "    const ::google::protobuf::Message& message,\n"
        "    const ::rdmarpc::generated::TensorWalk& walk) {\n"
        "  const auto& m = static_cast<const $class$&>(message);\n");
    for (const FieldDescriptor* field : WalkedFields(*type)) {
      const Vars vars = {
          {"name", google::protobuf::compiler::cpp::FieldName(field)},
          {"number", std::to_string(field->number())},
          {"visit", field->message_type()->full_name() == kTensorType
                        ? "VisitTensor"
                        : "VisitMessage"}};
      if (field->is_map()) {
        // Map order is not stable across peers.
        p->Print(vars,
                 "  if (!m.$name$().empty()) {\n"
                 "    return ::rdmarpc::generated::MapHoldsTensors(\n"
                 "        message, $number$);\n"
                 "  }\n");
      } else if (field->is_repeated()) {
        p->Print(vars,
                 "  for (const auto& element : m.$name$()) {\n"
                 "    RDMARPC_RETURN_IF_ERROR(\n"
                 "        ::rdmarpc::generated::$visit$(walk, $number$, "
                 "element));\n"
                 "  }\n");
      } else {
        p->Print(vars,
                 "  if (m.has_$name$()) {\n"
                 "    RDMARPC_RETURN_IF_ERROR(\n"
                 "        ::rdmarpc::generated::$visit$(walk, $number$, "
                 "m.$name$()));\n"
                 "  }\n");
      }
    }
    p->Print(
        "  return ::absl::OkStatus();\n"
        "}\n");
  }
  p->Print(
      "\n"
      "// Registered before main(): the runtime walks these classes'\n"
      "// messages with the walkers above.\n"
      "[[maybe_unused]] const bool tensor_walkers_registered =");
  for (size_t i = 0; i < types.size(); ++i) {
    p->Print({{"walker", WalkerName(*types[i])},
              {"class",
               google::protobuf::compiler::cpp::QualifiedClassName(types[i])},
              {"and", i + 1 < types.size() ? " &&" : ";"}},
             "\n"
             "    ::rdmarpc::generated::RegisterTensorWalker(\n"
             "        typeid($class$), &$walker$)$and$");
  }
  p->Print(
      "\n"
      "\n"
      "}  // namespace\n");
}

// Runs `body` inside the file's package namespace (if it has a package).
template <typename Body>
void PrintInNamespace(const FileDescriptor& file, Printer* p, Body body) {
  const std::string ns = CppNamespace(file);
  if (!ns.empty()) p->Print("namespace $ns$ {\n\n", "ns", ns);
  body();
  if (!ns.empty()) p->Print("\n}  // namespace $ns$\n", "ns", ns);
}

void WriteHeader(const FileDescriptor& file, const std::string& stem,
                 GeneratorContext* context) {
  const std::string name = stem + ".rdmarpc.pb.h";
  std::unique_ptr<ZeroCopyOutputStream> out(context->Open(name));
  Printer p(out.get(), '$');
  const Vars vars = {{"proto", file.name()},
                     {"guard", IncludeGuard(name)},
                     {"pb_h", stem + ".pb.h"}};
  p.Print(vars,
          "// Generated by protoc-gen-rdmarpc from $proto$. DO NOT EDIT.\n");
  if (file.service_count() == 0) {
    p.Print(vars,
            "// $proto$ declares no services.\n"
            "#ifndef $guard$\n"
            "#define $guard$\n"
            "\n"
            "#include \"$pb_h$\"\n"
            "\n"
            "#endif  // $guard$\n");
    return;
  }
  p.Print(vars,
          "#ifndef $guard$\n"
          "#define $guard$\n"
          "\n"
          "#include <functional>\n"
          "#include <future>\n"
          "#include <memory>\n"
          "\n"
          "#include \"$pb_h$\"\n"
          "#include \"rdmarpc/channel.h\"\n"
          "#include \"rdmarpc/server.h\"\n"
          "\n");
  PrintInNamespace(file, &p, [&] {
    for (int i = 0; i < file.service_count(); ++i) {
      if (i > 0) p.Print("\n");
      PrintServiceDeclaration(*file.service(i), &p);
    }
  });
  p.Print(vars, "\n#endif  // $guard$\n");
}

void WriteSource(const FileDescriptor& file, const std::string& stem,
                 GeneratorContext* context) {
  std::unique_ptr<ZeroCopyOutputStream> out(
      context->Open(stem + ".rdmarpc.pb.cc"));
  Printer p(out.get(), '$');
  const Vars vars = {{"proto", file.name()},
                     {"header", stem + ".rdmarpc.pb.h"}};
  const std::vector<const Descriptor*> walked = WalkedTypes(file);
  p.Print(vars,
          "// Generated by protoc-gen-rdmarpc from $proto$. DO NOT EDIT.\n");
  if (file.service_count() == 0) {
    p.Print(vars, "// $proto$ declares no services.\n");
    if (walked.empty()) {
      p.Print(vars, "#include \"$header$\"\n");
      return;
    }
  }
  p.Print(vars, "#include \"$header$\"\n\n");
  if (!walked.empty()) p.Print("#include <typeinfo>\n");
  if (file.service_count() > 0) p.Print("#include <utility>\n");
  p.Print("\n");
  if (!walked.empty()) {
    p.Print("#include \"rdmarpc/generated_support.h\"\n\n");
  }
  PrintInNamespace(file, &p, [&] {
    for (int i = 0; i < file.service_count(); ++i) {
      if (i > 0) p.Print("\n");
      PrintServiceDefinition(*file.service(i), &p);
    }
    if (!walked.empty()) {
      if (file.service_count() > 0) p.Print("\n");
      PrintTensorWalkers(walked, &p);
    }
  });
}

}  // namespace

bool Generator::Generate(const FileDescriptor* file,
                         const std::string& parameter,
                         GeneratorContext* context, std::string* error) const {
  if (!parameter.empty()) {
    *error = "rdmarpc: unknown option \"" + parameter +
             "\"; protoc-gen-rdmarpc takes no options";
    return false;
  }
  if (!Validate(*file, error)) return false;
  const std::string stem = google::protobuf::compiler::StripProto(file->name());
  WriteHeader(*file, stem, context);
  WriteSource(*file, stem, context);
  return true;
}

}  // namespace rdmarpc::codegen
