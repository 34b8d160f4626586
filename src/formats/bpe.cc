// The BPE model: one pre-tokenized piece to token ids.
//
// The piece starts as one symbol per character (or per byte through <0xXX> tokens with byte
// fallback, or <unk>); then the adjacent pair with the lowest merge rank is merged, the
// leftmost first among equal ranks, until no pair has a merge. A heap of candidate merges
// with lazy invalidation keeps this O(n log n), so a long piece (a CJK paragraph has no
// spaces to split it) does not cost n^2.
#include <queue>

#include "fuyou/error.h"
#include "src/formats/tokenizer_impl.h"
#include "src/formats/unicode.h"

namespace fuyou::tok {
namespace {

struct Symbol {
  int32_t id;
  int prev, next;  // indices into the symbol array, -1 at the ends
  bool alive;
};

struct Candidate {
  int32_t rank;
  int pos;  // index of the left symbol
  int32_t new_id;
  // std::priority_queue is a max-heap: "less" means lower priority, i.e. a larger rank or,
  // for equal ranks, a later position.
  bool operator<(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

}  // namespace

void BpeModel::tokenize(std::string_view piece, std::vector<int32_t>* out) const {
  if (piece.empty()) return;
  if (ignore_merges) {
    auto it = vocab.find(std::string(piece));
    if (it != vocab.end()) {
      out->push_back(it->second);
      return;
    }
  }
  std::vector<Symbol> sym;
  sym.reserve(piece.size());
  auto push = [&](int32_t id) { sym.push_back({id, static_cast<int>(sym.size()) - 1, -1, true}); };
  // An unknown character becomes <unk>, consecutive ones one <unk> with fuse_unk. The
  // pending <unk> is flushed by the next known character, not by byte-fallback tokens,
  // which is the order the tokenizers library produces.
  bool unk_pending = false;
  std::string ch;
  for (size_t i = 0; i < piece.size();) {
    size_t len;
    unicode::decode(piece, i, &len);
    ch.assign(piece.substr(i, len));
    i += len;
    auto it = vocab.find(ch);
    if (it != vocab.end()) {
      if (unk_pending) push(unk_id);
      unk_pending = false;
      push(it->second);
      continue;
    }
    if (byte_fallback) {
      bool all = true;
      for (unsigned char b : ch) all = all && byte_ids[b] >= 0;
      if (all) {
        for (unsigned char b : ch) push(byte_ids[b]);
        continue;
      }
    }
    if (unk_id >= 0) {
      if (unk_pending && !fuse_unk) push(unk_id);
      unk_pending = true;
    } else if (!unk_token.empty()) {
      throw Error(
          str("tokenizer: unk_token '", unk_token, "' is needed but is not in the vocabulary"));
    }
    // Without an unk token the character is dropped, as the library does.
  }
  if (unk_pending) push(unk_id);
  for (size_t k = 0; k + 1 < sym.size(); ++k) sym[k].next = static_cast<int>(k) + 1;

  auto lookup = [&](int32_t a, int32_t b) -> const Merge* {
    auto it = merges.find(static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32 |
                          static_cast<uint32_t>(b));
    return it == merges.end() ? nullptr : &it->second;
  };
  std::priority_queue<Candidate> heap;
  for (size_t k = 0; k + 1 < sym.size(); ++k)
    if (const Merge* m = lookup(sym[k].id, sym[k + 1].id))
      heap.push({m->rank, static_cast<int>(k), m->new_id});
  while (!heap.empty()) {
    Candidate c = heap.top();
    heap.pop();
    Symbol& left = sym[c.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = sym[left.next];
    // Stale entries (either side merged since) no longer produce the same token.
    const Merge* m = lookup(left.id, right.id);
    if (!m || m->new_id != c.new_id) continue;
    left.id = c.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) sym[right.next].prev = c.pos;
    if (left.prev >= 0)
      if (const Merge* pm = lookup(sym[left.prev].id, left.id))
        heap.push({pm->rank, left.prev, pm->new_id});
    if (left.next >= 0)
      if (const Merge* nm = lookup(left.id, sym[left.next].id))
        heap.push({nm->rank, c.pos, nm->new_id});
  }
  for (int k = sym.empty() ? -1 : 0; k >= 0; k = sym[k].next) out->push_back(sym[k].id);
}

}  // namespace fuyou::tok
