// ReflectionAnswerer: requests and answers as bytes, against a descriptor
// pool built here (two files, one importing the other, with an extension).
#include "transport/grpc/reflection.h"

#include <gtest/gtest.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/unknown_field_set.h"

namespace rdmarpc::grpc_transport {
namespace {

using google::protobuf::FileDescriptorProto;
using google::protobuf::UnknownField;
using google::protobuf::UnknownFieldSet;
// UnknownFieldSet can be neither copied nor moved.
using Fields = std::unique_ptr<UnknownFieldSet>;

constexpr char kBase[] = R"pb(
  name: "base.proto"
  package: "base"
  syntax: "proto2"
  message_type {
    name: "Options"
    extension_range { start: 100 end: 200 }
  }
)pb";

constexpr char kUser[] = R"pb(
  name: "user.proto"
  package: "user"
  syntax: "proto2"
  dependency: "base.proto"
  message_type {
    name: "Req"
    field { name: "x" number: 1 label: LABEL_OPTIONAL type: TYPE_INT32 }
  }
  extension {
    name: "tag"
    number: 123
    label: LABEL_OPTIONAL
    type: TYPE_STRING
    extendee: ".base.Options"
  }
  service {
    name: "Svc"
    method { name: "Run" input_type: ".user.Req" output_type: ".user.Req" }
  }
)pb";

class ReflectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* text : {kBase, kUser}) {
      FileDescriptorProto proto;
      ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &proto));
      ASSERT_NE(pool_.BuildFile(proto), nullptr) << proto.name();
    }
  }

  // Asks `request` and returns the answer's fields.
  Fields Ask(const Fields& request) {
    std::string bytes;
    request->SerializeToString(&bytes);
    StatusOr<std::string> answer = answerer_.Answer(bytes, &sent_);
    EXPECT_TRUE(answer.ok()) << answer.status();
    auto fields = std::make_unique<UnknownFieldSet>();
    EXPECT_TRUE(fields->ParseFromString(answer.value_or("")));
    return fields;
  }

  static Fields Request(int field, const std::string& value) {
    auto request = std::make_unique<UnknownFieldSet>();
    request->AddLengthDelimited(field, value);
    return request;
  }

  // The nested message in field `number`, parsed.
  static Fields Nested(const Fields& fields, int number) {
    auto nested = std::make_unique<UnknownFieldSet>();
    for (int i = 0; i < fields->field_count(); ++i) {
      if (fields->field(i).number() == number) {
        EXPECT_TRUE(
            nested->ParseFromString(fields->field(i).length_delimited()));
        return nested;
      }
    }
    ADD_FAILURE() << "no field " << number;
    return nested;
  }

  // The names of the files in a file_descriptor_response, in order.
  static std::vector<std::string> FileNames(const Fields& answer) {
    Fields files = Nested(answer, 4);
    std::vector<std::string> names;
    for (int i = 0; i < files->field_count(); ++i) {
      FileDescriptorProto proto;
      EXPECT_TRUE(proto.ParseFromString(files->field(i).length_delimited()));
      names.push_back(proto.name());
    }
    return names;
  }

  static std::pair<uint64_t, std::string> Error(const Fields& answer) {
    Fields error = Nested(answer, 7);
    std::pair<uint64_t, std::string> out{0, ""};
    for (int i = 0; i < error->field_count(); ++i) {
      if (error->field(i).number() == 1) out.first = error->field(i).varint();
      if (error->field(i).number() == 2) {
        out.second = error->field(i).length_delimited();
      }
    }
    return out;
  }

  google::protobuf::DescriptorPool pool_;
  ReflectionAnswerer answerer_{{"user.Svc", "grpc.health.v1.Health"}, &pool_};
  std::set<std::string> sent_;
};

TEST_F(ReflectionTest, ListsTheServicesItWasGivenAndEchoesTheRequest) {
  Fields request = Request(7, "");
  request->AddLengthDelimited(1, "example.com");
  Fields answer = Ask(request);
  Fields list = Nested(answer, 6);
  std::vector<std::string> names;
  for (int i = 0; i < list->field_count(); ++i) {
    UnknownFieldSet service;
    ASSERT_TRUE(service.ParseFromString(list->field(i).length_delimited()));
    names.push_back(service.field(0).length_delimited());
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"user.Svc", "grpc.health.v1.Health"}));
  EXPECT_EQ(answer->field(0).number(), 1);
  EXPECT_EQ(answer->field(0).length_delimited(), "example.com");
  std::string sent;
  request->SerializeToString(&sent);
  EXPECT_EQ(Nested(answer, 2)->field_count(), 2);
  EXPECT_EQ(answer->field(1).length_delimited(), sent);
}

TEST_F(ReflectionTest, SendsImportsFirstAndEachFileOncePerStream) {
  EXPECT_EQ(FileNames(Ask(Request(4, "user.Svc"))),
            (std::vector<std::string>{"base.proto", "user.proto"}));
  // Same stream: base.proto went out already; the file asked for goes
  // out again.
  EXPECT_EQ(FileNames(Ask(Request(4, "user.Req"))),
            (std::vector<std::string>{"user.proto"}));
  EXPECT_EQ(FileNames(Ask(Request(3, "base.proto"))),
            (std::vector<std::string>{"base.proto"}));
  sent_.clear();  // a new stream
  EXPECT_EQ(FileNames(Ask(Request(3, "user.proto"))),
            (std::vector<std::string>{"base.proto", "user.proto"}));
}

TEST_F(ReflectionTest, FindsExtensions) {
  UnknownFieldSet ext;
  ext.AddLengthDelimited(1, "base.Options");
  ext.AddVarint(2, 123);
  std::string ext_bytes;
  ext.SerializeToString(&ext_bytes);
  EXPECT_EQ(FileNames(Ask(Request(5, ext_bytes))),
            (std::vector<std::string>{"base.proto", "user.proto"}));

  Fields numbers = Nested(Ask(Request(6, "base.Options")), 5);
  ASSERT_EQ(numbers->field_count(), 2);
  EXPECT_EQ(numbers->field(0).length_delimited(), "base.Options");
  EXPECT_EQ(numbers->field(1).varint(), 123u);
}

TEST_F(ReflectionTest, WhatIsNotFoundIsAnErrorResponseNamingIt) {
  for (auto [field, what] : std::vector<std::pair<int, std::string>>{
           {3, "no.proto"}, {4, "no.Such"}, {6, "no.Such"}}) {
    auto [code, message] = Error(Ask(Request(field, what)));
    EXPECT_EQ(code, 5u) << what;  // NOT_FOUND
    EXPECT_NE(message.find(what), std::string::npos) << message;
  }
  UnknownFieldSet ext;
  ext.AddLengthDelimited(1, "base.Options");
  ext.AddVarint(2, 150);
  std::string ext_bytes;
  ext.SerializeToString(&ext_bytes);
  auto [code, message] = Error(Ask(Request(5, ext_bytes)));
  EXPECT_EQ(code, 5u);
  EXPECT_NE(message.find("150"), std::string::npos) << message;
}

TEST_F(ReflectionTest, BadRequestsAreRefused) {
  // Nothing asked: an error response.
  auto [code, message] = Error(Ask(Request(1, "host-only")));
  EXPECT_EQ(code, 3u);  // INVALID_ARGUMENT
  EXPECT_NE(message.find("list_services"), std::string::npos) << message;
  // Not protobuf at all (a truncated length-delimited field): the stream
  // ends with INVALID_ARGUMENT.
  StatusOr<std::string> garbage = answerer_.Answer("\x22\x10xy", &sent_);
  EXPECT_EQ(garbage.status().code(), absl::StatusCode::kInvalidArgument);
  // A file_containing_extension that is not an ExtensionRequest.
  StatusOr<std::string> bad_ext =
      answerer_.Answer(std::string("\x2a\x02\x0a\x05", 4), &sent_);
  EXPECT_EQ(bad_ext.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rdmarpc::grpc_transport
