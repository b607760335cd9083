#include "transport/grpc/reflection.h"

#include <climits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/unknown_field_set.h"

namespace rdmarpc::grpc_transport {

namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::FileDescriptor;
using google::protobuf::UnknownField;
using google::protobuf::UnknownFieldSet;

// Field numbers of grpc/reflection/v1/reflection.proto (v1alpha has the
// same messages under another package).
namespace request {
constexpr int kHost = 1;
constexpr int kFileByFilename = 3;
constexpr int kFileContainingSymbol = 4;
constexpr int kFileContainingExtension = 5;
constexpr int kAllExtensionNumbersOfType = 6;
constexpr int kListServices = 7;
}  // namespace request
namespace extension_request {
constexpr int kContainingType = 1;
constexpr int kExtensionNumber = 2;
}  // namespace extension_request
namespace response {
constexpr int kValidHost = 1;
constexpr int kOriginalRequest = 2;
constexpr int kFileDescriptorResponse = 4;
constexpr int kAllExtensionNumbersResponse = 5;
constexpr int kListServicesResponse = 6;
constexpr int kErrorResponse = 7;
}  // namespace response
// FileDescriptorResponse.file_descriptor_proto, ListServiceResponse.service,
// ServiceResponse.name, ExtensionNumberResponse.base_type_name and
// ErrorResponse.error_code are all field 1.
constexpr int kFirst = 1;
constexpr int kExtensionNumbers = 2;  // ExtensionNumberResponse
constexpr int kErrorMessage = 2;      // ErrorResponse

void SetError(UnknownFieldSet* answer, absl::StatusCode code,
              std::string message) {
  UnknownFieldSet error;
  error.AddVarint(kFirst, static_cast<uint64_t>(code));
  error.AddLengthDelimited(kErrorMessage, message);
  error.SerializeToString(answer->AddLengthDelimited(response::kErrorResponse));
}

// Adds `file` and, before it, the files it imports that `sent` lacks.
void AddFile(const FileDescriptor* file, std::set<std::string>* sent,
             UnknownFieldSet* files) {
  if (!sent->insert(file->name()).second) return;
  for (int i = 0; i < file->dependency_count(); ++i) {
    AddFile(file->dependency(i), sent, files);
  }
  google::protobuf::FileDescriptorProto proto;
  file->CopyTo(&proto);
  proto.SerializeToString(files->AddLengthDelimited(kFirst));
}

void SetFile(UnknownFieldSet* answer, const FileDescriptor* file,
             std::set<std::string>* sent) {
  UnknownFieldSet files;
  // The file asked for always goes out, even when sent before on this
  // stream: the client asked for it again.
  sent->erase(file->name());
  AddFile(file, sent, &files);
  files.SerializeToString(
      answer->AddLengthDelimited(response::kFileDescriptorResponse));
}

}  // namespace

ReflectionAnswerer::ReflectionAnswerer(
    std::vector<std::string> services,
    const google::protobuf::DescriptorPool* pool)
    : services_(std::move(services)), pool_(pool) {}

StatusOr<std::string> ReflectionAnswerer::Answer(
    std::string_view request, std::set<std::string>* files_sent) const {
  UnknownFieldSet fields;
  if (request.size() > INT_MAX ||
      !fields.ParseFromArray(request.data(),
                             static_cast<int>(request.size()))) {
    return absl::InvalidArgumentError(
        "reflection: the request is not a ServerReflectionRequest");
  }
  // Proto3: the last value of a field (and of the oneof) wins.
  std::string host;
  const UnknownField* asked = nullptr;
  for (int i = 0; i < fields.field_count(); ++i) {
    const UnknownField& f = fields.field(i);
    if (f.type() != UnknownField::TYPE_LENGTH_DELIMITED) continue;
    switch (f.number()) {
      case request::kHost:
        host = f.length_delimited();
        break;
      case request::kFileByFilename:
      case request::kFileContainingSymbol:
      case request::kFileContainingExtension:
      case request::kAllExtensionNumbersOfType:
      case request::kListServices:
        asked = &f;
        break;
    }
  }

  UnknownFieldSet answer;
  answer.AddLengthDelimited(response::kValidHost, host);
  answer.AddLengthDelimited(response::kOriginalRequest, std::string(request));
  if (asked == nullptr) {
    SetError(&answer, absl::StatusCode::kInvalidArgument,
             "the request asks for nothing (set one of file_by_filename, "
             "file_containing_symbol, file_containing_extension, "
             "all_extension_numbers_of_type, list_services)");
  } else if (asked->number() == request::kListServices) {
    UnknownFieldSet list;
    for (const std::string& name : services_) {
      UnknownFieldSet service;
      service.AddLengthDelimited(kFirst, name);
      service.SerializeToString(list.AddLengthDelimited(kFirst));
    }
    list.SerializeToString(
        answer.AddLengthDelimited(response::kListServicesResponse));
  } else if (asked->number() == request::kFileByFilename ||
             asked->number() == request::kFileContainingSymbol) {
    const std::string& name = asked->length_delimited();
    const bool by_name = asked->number() == request::kFileByFilename;
    const FileDescriptor* file = by_name
                                     ? pool_->FindFileByName(name)
                                     : pool_->FindFileContainingSymbol(name);
    if (file != nullptr) {
      SetFile(&answer, file, files_sent);
    } else {
      SetError(&answer, absl::StatusCode::kNotFound,
               absl::StrCat(by_name ? "file " : "symbol ", name, " not found"));
    }
  } else if (asked->number() == request::kFileContainingExtension) {
    UnknownFieldSet ext;
    if (!ext.ParseFromString(asked->length_delimited())) {
      return absl::InvalidArgumentError(
          "reflection: file_containing_extension is not an ExtensionRequest");
    }
    std::string type;
    int64_t number = 0;
    for (int i = 0; i < ext.field_count(); ++i) {
      const UnknownField& f = ext.field(i);
      if (f.number() == extension_request::kContainingType &&
          f.type() == UnknownField::TYPE_LENGTH_DELIMITED) {
        type = f.length_delimited();
      } else if (f.number() == extension_request::kExtensionNumber &&
                 f.type() == UnknownField::TYPE_VARINT) {
        number = static_cast<int32_t>(f.varint());
      }
    }
    const Descriptor* message = pool_->FindMessageTypeByName(type);
    const FieldDescriptor* extension =
        message == nullptr
            ? nullptr
            : pool_->FindExtensionByNumber(message, static_cast<int>(number));
    if (extension != nullptr) {
      SetFile(&answer, extension->file(), files_sent);
    } else {
      SetError(&answer, absl::StatusCode::kNotFound,
               absl::StrCat("extension ", number, " of ", type, " not found"));
    }
  } else {  // kAllExtensionNumbersOfType
    const std::string& type = asked->length_delimited();
    if (const Descriptor* message = pool_->FindMessageTypeByName(type)) {
      std::vector<const FieldDescriptor*> extensions;
      pool_->FindAllExtensions(message, &extensions);
      UnknownFieldSet numbers;
      numbers.AddLengthDelimited(kFirst, type);
      for (const FieldDescriptor* e : extensions) {
        numbers.AddVarint(kExtensionNumbers,
                          static_cast<uint64_t>(e->number()));
      }
      numbers.SerializeToString(
          answer.AddLengthDelimited(response::kAllExtensionNumbersResponse));
    } else {
      SetError(&answer, absl::StatusCode::kNotFound,
               absl::StrCat("type ", type, " not found"));
    }
  }
  std::string out;
  answer.SerializeToString(&out);
  return out;
}

}  // namespace rdmarpc::grpc_transport
