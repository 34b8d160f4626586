// safetensors and token shards: round trips, and malformed files refused with an error
// that names the file and what is wrong.
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "fuyou/config.h"
#include "fuyou/data.h"
#include "fuyou/error.h"
#include "fuyou/read_file.h"
#include "fuyou/rng.h"
#include "fuyou/safetensors.h"
#include "src/formats/safetensors_stream.h"

namespace fs = std::filesystem;
using namespace fuyou;
using Catch::Matchers::Contains;

namespace {

std::string temp_dir(const std::string& name) {
  fs::path p =
      fs::temp_directory_path() / ("fuyou-test-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

void write_raw(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string st_file(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + std::string(data_bytes, '\0');
}

}  // namespace

TEST_CASE("safetensors round trip", "[formats]") {
  std::string dir = temp_dir("st");
  SafetensorsWriter w;
  w.set_metadata("step", "7");
  std::vector<float> a = {1, 2, 3, 4, 5, 6};
  std::vector<int32_t> b = {-1, 9};
  w.add("a", StDtype::kF32, {2, 3}, a.data());
  w.add("b", StDtype::kI32, {2}, b.data());
  w.write(dir + "/x.safetensors");
  CHECK_FALSE(fs::exists(dir + "/x.safetensors.tmp"));
  SafetensorsReader r(dir + "/x.safetensors");
  CHECK(r.metadata().at("step") == "7");
  CHECK(r.read_f32("a", {2, 3}) == a);
  CHECK(r.read_i32("b") == b);
  CHECK_THROWS_WITH(r.read_f32("a", {3, 2}), Contains("has shape [2, 3], expected [3, 2]"));
  CHECK_THROWS_WITH(r.read_f32("b"), Contains("dtype I32, expected F32"));
  CHECK_THROWS_WITH(r.info("c"), Contains("no tensor named 'c'"));
}

TEST_CASE("the streaming writer's O_DIRECT chunks make the same file as the in-memory writer",
          "[formats]") {
  // 16 MiB chunks: tensors that cross chunk boundaries at odd offsets, appended in odd
  // pieces, and a tail that is not a whole 4 KiB block; under the build tree (O_DIRECT), and
  // with writes whose short counts force the buffered fallback part-way.
  const std::string dir =
      (fs::path(FUYOU_BINARY_DIR) / "test-data" / ("st-direct-" + std::to_string(::getpid())))
          .string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::vector<float> big(5'000'003), odd(777);
  Rng rng(5);
  for (auto& x : big) x = static_cast<float>(rng.uniform());
  for (auto& x : odd) x = static_cast<float>(rng.uniform());
  SafetensorsWriter ref;
  ref.set_metadata("k", "v");
  ref.add("big", StDtype::kF32, {5'000'003}, big.data());
  ref.add("odd", StDtype::kF32, {7, 111}, odd.data());
  ref.add("big2", StDtype::kF32, {5'000'003}, big.data());
  ref.write(dir + "/ref.safetensors");
  const std::string want = read_file_bounded(dir + "/ref.safetensors", 1ull << 30, "reference");
  for (bool short_writes : {false, true}) {
    INFO("short writes " << short_writes);
    const std::string path = dir + (short_writes ? "/short.safetensors" : "/direct.safetensors");
    SafetensorsStreamWriter w(path,
                              {{"big", StDtype::kF32, {5'000'003}},
                               {"odd", StDtype::kF32, {7, 111}},
                               {"big2", StDtype::kF32, {5'000'003}}},
                              {{"k", "v"}});
    std::atomic<int> calls{0};
    if (short_writes)  // the third write call comes back short, by an unaligned count
      w.set_write_function([&](int fd, const void* p, size_t n, uint64_t at) {
        return ::pwrite(fd, p, ++calls == 3 ? 1000 : n, static_cast<off_t>(at));
      });
    for (const char* name : {"big", "odd", "big2"}) {
      w.begin_tensor(name);
      const std::vector<float>& v = std::string(name) == "odd" ? odd : big;
      for (size_t at = 0; at < v.size(); at += 1'234'567)
        w.append(v.data() + at, 4 * std::min<size_t>(1'234'567, v.size() - at));
    }
    w.finish();
    CHECK_FALSE(fs::exists(path + ".tmp"));
    CHECK(fs::file_size(path) == want.size());
    CHECK((read_file_bounded(path, 1ull << 30, "streamed") == want));
    SafetensorsReader r(path);
    CHECK(r.read_f32("odd", {7, 111}) == odd);
  }
  fs::remove_all(dir);
}

TEST_CASE("malformed safetensors files are refused with the file and the field", "[formats]") {
  std::string dir = temp_dir("stbad");
  std::string p = dir + "/bad.safetensors";
  auto refuse = [&](const std::string& bytes, const std::string& expect) {
    write_raw(p, bytes);
    CHECK_THROWS_WITH(SafetensorsReader(p), Contains(p) && Contains(expect));
  };
  refuse("abc", "too short");
  std::string huge(8, '\xff');
  refuse(huge, "runs past the end");
  refuse(st_file("{not json", 0), "not valid JSON");
  refuse(st_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8),
         "outside the 8-byte data section");
  refuse(st_file(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "need 12");
  refuse(st_file(R"({"t":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8),
         "unsupported dtype 'Q7'");
  refuse(st_file(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "non-negative");
  refuse(
      st_file(
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          16),
      "overlap");
  refuse(st_file(R"({"t":{"dtype":"F32","shape":[2]}})", 8), "data_offsets");
  // The tensors must tile the data section: no gap before, between or after them.
  refuse(st_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
         "data bytes [0, 4) belong to no tensor");
  refuse(
      st_file(
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
          20),
      "data bytes [8, 12) belong to no tensor (gap before 'b')");
  refuse(st_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12),
         "4 trailing bytes");
  refuse(st_file(R"({})", 1), "1 trailing bytes");
  // A shape whose element count overflows 64 bits must not wrap into a small size.
  refuse(
      st_file(R"({"t":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})", 0),
      "overflow 64 bits");
  refuse(
      st_file(
          R"({"t":{"dtype":"F32","shape":[2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,1],"data_offsets":[0,8]}})",
          8),
      "at most 16");
  refuse(st_file("{\"\xff\xfe\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1),
         "not valid JSON");
  refuse(st_file(R"({"":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1), "empty name");
  refuse(st_file(R"( {})", 0), "does not start with '{'");
  refuse(st_file(R"(x)", 0), "too short for a JSON object");

  // Zero-size tensors take no bytes and may sit at any tensor boundary.
  write_raw(
      p,
      st_file(
          R"({"e":{"dtype":"F32","shape":[0],"data_offsets":[8,8]},"z":{"dtype":"F32","shape":[2,0],"data_offsets":[0,0]},"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
          8));
  CHECK(SafetensorsReader(p).tensors().size() == 3);

  // Bounded random mutation of a valid file: every outcome is a clean IoError or success.
  SafetensorsWriter w;
  std::vector<float> a(16, 1.0f);
  w.add("weight", StDtype::kF32, {4, 4}, a.data());
  w.add("bias", StDtype::kF32, {4}, a.data());
  w.write(p);
  std::ifstream in(p, std::ios::binary);
  std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Rng rng(3);
  int refused = 0;
  for (int i = 0; i < 2000; ++i) {
    std::string m = good;
    int edits = 1 + static_cast<int>(rng.below(4));
    for (int e = 0; e < edits; ++e) m[rng.below(m.size())] = static_cast<char>(rng.below(256));
    if (rng.below(4) == 0) m.resize(rng.below(m.size()));
    write_raw(p, m);
    try {
      SafetensorsReader r(p);
      for (const auto& t : r.tensors()) {
        std::vector<char> buf(t.end - t.begin);
        r.read_raw(t.name, buf.data());
      }
    } catch (const IoError&) {
      ++refused;
    }
  }
  CHECK(refused > 0);
}

// A header length field a few bytes short ends the header inside its own space padding:
// the JSON still parses, and without the tiling check every tensor was read a few bytes off.
TEST_CASE("a safetensors header length 1-7 bytes short is refused", "[formats]") {
  std::string dir = temp_dir("stshort");
  std::string p = dir + "/short.safetensors";
  std::string json = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  std::string header = json + std::string(7, ' ');
  std::string data(16, '\x3f');
  write_raw(p, st_file(header, 0) + data);
  REQUIRE(SafetensorsReader(p).tensors().size() == 1);
  for (uint64_t short_by = 1; short_by <= 7; ++short_by) {
    std::string bytes = st_file(header, 0) + data;
    uint64_t len = header.size() - short_by;
    std::memcpy(bytes.data(), &len, 8);
    write_raw(p, bytes);
    INFO("header length short by " << short_by);
    CHECK_THROWS_WITH(SafetensorsReader(p),
                      Contains(p) && Contains(str(short_by, " trailing bytes")));
  }
}

TEST_CASE("a safetensors header above the size limit is refused before it is read", "[formats]") {
  std::string dir = temp_dir("sthuge");
  std::string p = dir + "/huge.safetensors";
  // A sparse file larger than the limit, whose length field claims a header one byte over it.
  std::string len(8, '\0');
  uint64_t n = kMaxStHeader + 1;
  std::memcpy(len.data(), &n, 8);
  write_raw(p, len);
  fs::resize_file(p, kMaxStHeader + 64);
  CHECK_THROWS_WITH(SafetensorsReader(p), Contains(p) && Contains("above the limit"));
}

TEST_CASE("index.json shard names stay in the model directory", "[formats]") {
  const std::string idx = "dir/model.safetensors.index.json";
  auto refuse = [&](const std::string& text, const std::string& expect) {
    CHECK_THROWS_WITH(parse_st_index(text, idx), Contains(idx) && Contains(expect));
  };
  for (const char* bad : {"../x.safetensors", "/etc/passwd", "a/b.safetensors", "..", ".", ""})
    refuse(str(R"({"weight_map":{"w":")", bad, R"("}})"), "is not a plain file name");
  refuse(R"({"weight_map":{"w":"x.safetensors\u0000/../../etc/passwd"}})",
         "'x.safetensors\\x00/../../etc/passwd' is not a plain file name");
  refuse(R"({"weight_map":{"w":3}})", "must be a file name string");
  refuse(R"({"weight_map":{"":"a.safetensors"}})", "empty tensor name");
  refuse(R"({"weight_map":{}})", "weight_map is empty");
  refuse(R"({"metadata":[],"weight_map":{"w":"a"}})", "'metadata' must be an object");
  refuse(R"([])", "must be a JSON object");
  auto map =
      parse_st_index(R"({"metadata":{"total_size":8},"weight_map":{"b":"s2","a":"s1"}})", idx);
  REQUIRE(map.size() == 2);
  CHECK(map[0] == std::pair<std::string, std::string>{"a", "s1"});
  CHECK(map[1] == std::pair<std::string, std::string>{"b", "s2"});
}

TEST_CASE("token shards round trip and reject corruption", "[formats]") {
  std::string dir = temp_dir("shard");
  std::vector<int32_t> toks = {0, 255, 17, 3};
  write_token_shard(dir + "/a.tok", toks, 256);
  TokenShard s = read_token_shard(dir + "/a.tok");
  CHECK(s.tokens == toks);
  CHECK(s.vocab_size == 256);
  std::vector<int32_t> big = {70000, 1};
  write_token_shard(dir + "/b.tok", big, 100000);
  CHECK(read_token_shard(dir + "/b.tok").tokens == big);
  CHECK(fs::file_size(dir + "/b.tok") == 32 + 2 * 4);
  CHECK_THROWS_WITH(write_token_shard(dir + "/c.tok", {300}, 256),
                    Contains("outside vocab size 256"));

  write_raw(dir + "/bad.tok", "NOTATOKENSHARD..................");
  CHECK_THROWS_WITH(read_token_shard(dir + "/bad.tok"), Contains("bad magic"));
  fs::resize_file(dir + "/a.tok", 32 + 5);
  CHECK_THROWS_WITH(read_token_shard(dir + "/a.tok"), Contains("header says 4 tokens"));

  // A header vocab size beyond int32 let a token such as 0xFFFFFFF0 pass the vocab check and
  // become a negative id.
  std::string h(32, '\0');
  std::memcpy(h.data(), kShardMagic, 8);
  const uint32_t version = kShardVersion, width = 4, vocab = 0xFFFFFFFFu, token = 0xFFFFFFF0u;
  const uint64_t count = 1;
  std::memcpy(h.data() + 8, &version, 4);
  std::memcpy(h.data() + 12, &width, 4);
  std::memcpy(h.data() + 16, &count, 8);
  std::memcpy(h.data() + 24, &vocab, 4);
  std::string bytes = h + std::string(reinterpret_cast<const char*>(&token), 4);
  write_raw(dir + "/neg.tok", bytes);
  CHECK_THROWS_WITH(read_token_shard(dir + "/neg.tok"),
                    Contains("vocab size 4294967295 at offset 24 is above the limit of 16777216"));
  CHECK_THROWS_WITH(parse_token_shard(bytes, "mem.tok"), Contains("mem.tok: vocab size"));
  // The in-memory parser reads what the file reader reads.
  write_token_shard(dir + "/c.tok", {5, 0, 65535}, 70000);
  std::ifstream in(dir + "/c.tok", std::ios::binary);
  std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK(parse_token_shard(file, "c").tokens == read_token_shard(dir + "/c.tok").tokens);
  CHECK_THROWS_WITH(parse_token_shard(file.substr(0, 31), "c"), Contains("shorter than"));
}

TEST_CASE("text files become byte-level train and validation shards", "[formats]") {
  std::string dir = temp_dir("text");
  fs::create_directories(dir + "/in/sub");
  write_raw(dir + "/in/a.txt", std::string(100, 'a'));
  write_raw(dir + "/in/sub/b.txt", std::string(50, 'b'));
  write_raw(dir + "/in/bin.dat", std::string("x\0y", 3));
  auto r = build_text_shards({dir + "/in"}, dir + "/out", 0.1);
  CHECK(r.files == 2);
  CHECK(r.skipped == 1);
  CHECK(r.train_tokens == 90 + 45);
  CHECK(r.val_tokens == 10 + 5);
  auto val = read_token_shard(r.val_path).tokens;
  CHECK(byte_decode(val) == std::string(10, 'a') + std::string(5, 'b'));
  CHECK_THROWS_WITH(build_text_shards({dir + "/missing"}, dir + "/out2", 0.1),
                    Contains("no such file"));
  CHECK(byte_encode("h\xc3\xa9") == std::vector<int32_t>{'h', 0xc3, 0xa9});
}

TEST_CASE("small files are read with a size bound", "[formats]") {
  std::string dir = temp_dir("bounded");
  write_raw(dir + "/f", std::string(1000, 'x'));
  CHECK(read_file_bounded(dir + "/f", 1000, "test").size() == 1000);
  CHECK_THROWS_WITH(read_file_bounded(dir + "/f", 999, "test"),
                    Contains(dir + "/f: the test file is larger than the limit of 999 bytes"));
  CHECK_THROWS_WITH(read_file_bounded(dir + "/missing", 10, "test"),
                    Contains("missing: cannot open test file"));
  // A file that reports no size (procfs) is read to the limit, not trusted by st_size.
  CHECK_THROWS_WITH(read_file_bounded("/proc/self/maps", 16, "test"), Contains("larger than"));
  // A config path that names a large file is refused before it is parsed.
  write_raw(dir + "/big.yaml", std::string((16u << 20) + 1, '#'));
  CHECK_THROWS_WITH(load_config_file(dir + "/big.yaml"), Contains("larger than the limit"));
}
